"""reproduce/eval/evaluate.py on the tiny model and the shipped fixtures: scores, files, checkpoints, errors."""

import csv
import importlib.util
import json

import numpy as np
import pytest
import torch

from common.checkpoint import save_checkpoint
from conftest import ROOT, run_script

SCRIPT = "../reproduce/eval/evaluate.py"  # run_script resolves it against algorithms/
FIX = ROOT / "tests" / "fixtures"
DATA = ["--data-paths", f"gsm8k={FIX / 'gsm8k'}", f"amc23={FIX / 'amc23.json'}"]


def load_evaluate():
    spec = importlib.util.spec_from_file_location("evaluate", ROOT / "reproduce" / "eval" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_avg_and_pass_at_n():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert load_evaluate().avg_and_pass_at_n(correct) == pytest.approx((5 / 12, 2 / 3))


def read_outputs(tmp_path):
    with open(tmp_path / "res.csv") as f:
        table = list(csv.DictReader(f))
    samples = [json.loads(line) for line in open(tmp_path / "res.samples.jsonl")]
    return table, samples


@pytest.mark.run
def test_scores_match_the_samples_written(tiny_model_path, tmp_path):
    run_script(
        SCRIPT,
        "--model",
        tiny_model_path,
        "--benchmarks",
        "gsm8k",
        "amc23",
        *DATA,
        "--n",
        "3",
        "--temperature",
        "1.0",
        "--max-new-tokens",
        "6",
        "--limit",
        "2",
        "--output",
        str(tmp_path / "res.csv"),
        cwd=tmp_path,
    )
    table, samples = read_outputs(tmp_path)
    assert [r["benchmark"] for r in table] == ["gsm8k", "amc23"] and all(r["problems"] == "2" for r in table)
    assert [r["prompt_template"] for r in table] == ["grpo", "m2po"]
    for row in table:
        mine = [s for s in samples if s["benchmark"] == row["benchmark"]]
        assert len(mine) == 2 * 3 and {s["gold"] for s in mine} <= {"18", "3", "142", "144"}
        assert float(row["avg@3"]) == pytest.approx(np.mean([s["correct"] for s in mine]), abs=1e-4)
        per_problem = [any(s["correct"] for s in mine if s["problem"] == p) for p in (0, 1)]
        assert float(row["pass@3"]) == pytest.approx(np.mean(per_problem), abs=1e-4)


@pytest.mark.run
def test_a_checkpoint_scores_its_own_weights(tiny_model_path, tmp_path):
    from common.models import load_model

    model = load_model(tiny_model_path)
    same = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    changed = {k: (v + torch.randn_like(v) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    for name, state in (("same", same), ("changed", changed)):
        save_checkpoint(
            tmp_path / name / "checkpoint.pt", {"args": {"model": tiny_model_path}, "update": 7, "model": state}
        )
    texts = {}
    for name, model_arg in (
        ("folder", tiny_model_path),
        ("same", str(tmp_path / "same")),
        ("changed", str(tmp_path / "changed" / "checkpoint.pt")),
    ):
        out = tmp_path / name / "res.csv"
        proc = run_script(
            SCRIPT,
            "--model",
            model_arg,
            "--benchmarks",
            "gsm8k",
            *DATA,
            "--max-new-tokens",
            "8",
            "--engine-dtype",
            "float32",
            "--output",
            str(out),
            cwd=tmp_path,
        )
        texts[name] = [json.loads(line)["response"] for line in open(out.with_suffix(".samples.jsonl"))]
        if name != "folder":
            assert "update 7 of a run on" in proc.stdout
    assert texts["same"] == texts["folder"]  # greedy: the checkpoint's weights give the folder's outputs
    assert texts["changed"] != texts["folder"]


@pytest.mark.run
def test_a_finished_run_folder_is_scored_by_its_trained_model(tiny_model_path, tmp_path):
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        "--digits",
        "1",
        "--prompts-per-batch",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--eval-size",
        "8",
        "--eval-every",
        "0",
        "--total-updates",
        "2",
        "--learning-rate",
        "1e-2",
        "--run-name",
        "r",
        cwd=tmp_path,
    )
    texts = {}
    for name, model_arg in (("run", str(tmp_path / "runs" / "r")), ("model", str(tmp_path / "runs" / "r" / "model"))):
        out = tmp_path / name / "res.csv"
        proc = run_script(
            SCRIPT,
            "--model",
            model_arg,
            "--benchmarks",
            "gsm8k",
            *DATA,
            "--max-new-tokens",
            "8",
            "--engine-dtype",
            "float32",
            "--output",
            str(out),
            cwd=tmp_path,
        )
        assert "checkpoint" not in proc.stdout
        assert f"[eval] model {tmp_path / 'runs' / 'r' / 'model'}\n" in proc.stdout
        texts[name] = [json.loads(line)["response"] for line in open(out.with_suffix(".samples.jsonl"))]
    assert texts["run"] == texts["model"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--n", "4"], "--temperature 0 is greedy"),
        (["--data-paths", "mmlu=x.json"], "expected NAME=PATH with NAME one of gsm8k, math500"),
        (["--benchmarks", "gsm9k"], "--benchmarks gsm9k: unknown"),
        (
            ["--benchmarks", "math500", "--data-paths", f"math500={FIX / 'math500.json'}", "--prompt-template", "grpo"],
            "grpo checks a plain number",
        ),
        (["--model", "/nowhere/checkpoint.pt"], "no checkpoint file"),
    ],
)
@pytest.mark.run
def test_bad_input_is_a_clear_error(tiny_model_path, tmp_path, flags, message):
    args = ["--model", tiny_model_path, "--benchmarks", "gsm8k", *DATA] + flags
    proc = run_script(SCRIPT, *args, "--output", str(tmp_path / "r.csv"), cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
