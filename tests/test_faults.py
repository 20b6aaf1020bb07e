"""Runs that survive faults, end to end on the tiny Llama: non-finite steps skipped (every script), a SIGKILL after a
safety checkpoint resumed into the uninterrupted run, SIGTERM handled like Ctrl-C, a failed checkpoint write."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from common.models import load_model
from conftest import FAST, ROOT, assert_same_run, comparable, metrics_of, run_script

pytestmark = pytest.mark.run

EXTRA = {"dapo.py": ["--max-sampling-rounds", "50"], "vineppo.py": ["--mc-samples", "2"]}  # each script's fast settings


@pytest.mark.parametrize("script", ["grpo.py", "dapo.py", "m2po.py", "ppo_stale.py", "tba.py", "vineppo.py"])
def test_nonfinite_steps_change_nothing_and_end_the_run(tiny_model_path, tmp_path, script):
    """Updates 1-3 get a NaN gradient: each step is skipped and counted, and the third in a row ends the run with a
    checkpoint whose weights, optimizer state and engine weights are the initial ones."""
    proc = run_script(
        script,
        "--model",
        tiny_model_path,
        *FAST,
        *EXTRA.get(script, []),
        "--total-updates",
        "6",
        "--eval-every",
        "0",
        "--debug-nonfinite-at",
        "1",
        "2",
        "3",
        "--run-name",
        "nan",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "update 1: non-finite grad_norm nan: optimizer step skipped" in proc.stdout
    assert "updates 1-3: 3 in a row had a non-finite loss or gradient norm" in proc.stderr
    rows = [r for r in metrics_of(tmp_path, "nan") if "losses/grad_norm" in r]
    assert [r["losses/nonfinite_skips"] for r in rows] == [1, 2, 3]
    assert all(math.isnan(r["losses/grad_norm"]) for r in rows)
    ck = torch.load(tmp_path / "runs" / "nan" / "checkpoint.pt", weights_only=False)
    assert ck["update"] == 3 and ck["nonfinite_skips"] == 3
    assert ck["optimizer"]["state"] == {}  # AdamW never stepped
    initial = load_model(tiny_model_path).state_dict()
    for name, w in ck["model"].items():
        assert torch.equal(w, initial[name]), name
    for name, w in ck["engine_weights"].items():  # the engine's bf16 copy of the initial weights
        assert torch.equal(w, initial[name].to(w.dtype)), name


def test_isolated_nonfinite_step_is_skipped_and_the_run_goes_on(tiny_model_path, tmp_path):
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "3",
        "--eval-every",
        "0",
        "--debug-nonfinite-at",
        "2",
        "--run-name",
        "one",
        cwd=tmp_path,
    )
    assert "update 2: non-finite grad_norm nan: optimizer step skipped" in proc.stdout
    rows = [r for r in metrics_of(tmp_path, "one") if "losses/grad_norm" in r]
    assert [r["losses/nonfinite_skips"] for r in rows] == [0, 1, 1]
    assert [math.isfinite(r["losses/grad_norm"]) for r in rows] == [True, False, True]


def test_sigkill_after_a_safety_checkpoint_resumes_into_the_uninterrupted_run(tiny_model_path, tmp_path):
    """--checkpoint-minutes 1e-9 writes the wall-clock safety checkpoint after every update; the run is SIGKILLed
    right after update 4 is logged (its checkpoint is update 3's). The resumed run drops the row of update 4 that
    the killed run wrote, redoes it, and the finished run equals the uninterrupted one."""
    common = ["--model", tiny_model_path, *FAST, "--staleness", "2", "--updates-per-batch", "2", "--total-updates", "6"]
    run_script("grpo.py", *common, "--run-name", "full", cwd=tmp_path)
    killed = run_script(
        "grpo.py",
        *common,
        "--checkpoint-minutes",
        "1e-9",
        "--debug-kill-at",
        "4",
        "--run-name",
        "killed",
        cwd=tmp_path,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert torch.load(tmp_path / "runs" / "killed" / "checkpoint.pt", weights_only=False)["update"] == 3
    assert max(r["global_step"] for r in metrics_of(tmp_path, "killed")) == 4  # a row after the checkpoint's update
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "killed"), cwd=tmp_path)
    resumed, full = comparable(metrics_of(tmp_path, "killed")), comparable(metrics_of(tmp_path, "full"))
    assert [r["global_step"] for r in resumed if "losses/policy_loss" in r] == [1, 2, 3, 4, 5, 6]  # one row each
    assert_same_run(resumed, full)
    assert not (tmp_path / "runs" / "killed" / "checkpoint.pt").exists()  # it finished: the safety checkpoint goes


def test_a_finished_run_leaves_its_model_and_no_training_state_unless_asked(tiny_model_path, tmp_path):
    """Safety checkpoints after every update; a normal finish replaces them by the trained model (an HF folder that
    --model loads), or keeps the final state with --keep-final-state."""
    flags = ["--model", tiny_model_path, *FAST, "--total-updates", "3", "--checkpoint-minutes", "1e-9"]
    proc = run_script("grpo.py", *flags, "--run-name", "safe", cwd=tmp_path)
    folder = tmp_path / "runs" / "safe"
    assert sorted(os.listdir(folder)) == ["config.json", "metrics.jsonl", "model"]
    final = [r for r in metrics_of(tmp_path, "safe") if r["global_step"] == 3 and "eval/accuracy" in r][0]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 3 updates in ") and f"eval/accuracy {final['eval/accuracy']:.4g}; " in last
    assert last.endswith(f"model {os.path.join('runs', 'safe', 'model')}")
    trained = load_model(str(folder / "model")).state_dict()
    assert any(not torch.equal(w, load_model(tiny_model_path).state_dict()[k]) for k, w in trained.items())
    again = run_script(
        "grpo.py",
        "--model",
        str(folder / "model"),
        *FAST,
        "--total-updates",
        "1",
        "--run-name",
        "from_it",
        cwd=tmp_path,
    )  # --model takes the folder
    assert "done: 1 updates" in again.stdout
    proc = run_script("grpo.py", *flags, "--keep-final-state", "--run-name", "kept", cwd=tmp_path)
    assert torch.load(tmp_path / "runs" / "kept" / "checkpoint.pt", weights_only=False)["update"] == 3
    assert "training state" in proc.stdout.strip().splitlines()[-1]
    ck = torch.load(tmp_path / "runs" / "kept" / "checkpoint.pt", weights_only=False)
    for name, w in load_model(str(tmp_path / "runs" / "kept" / "model")).state_dict().items():
        assert torch.equal(w, ck["model"][name]), name  # the folder holds the final state's weights


def test_sigterm_stops_after_the_update_and_writes_a_checkpoint(tiny_model_path, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "algorithms" / "grpo.py"),
            "--model",
            tiny_model_path,
            *FAST,
            "--total-updates",
            "400",
            "--eval-every",
            "0",
            "--run-name",
            "term",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if "] 2/400" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at update" in out
    ck = torch.load(tmp_path / "runs" / "term" / "checkpoint.pt", weights_only=False)
    assert 2 <= ck["update"] < 400
    steps = [r["global_step"] for r in metrics_of(tmp_path, "term") if "losses/policy_loss" in r]
    assert steps == list(range(1, ck["update"] + 1))


SCRIPTS = ["grpo.py", "dapo.py", "m2po.py", "ppo_stale.py", "tba.py", "vineppo.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_in_the_first_evaluation_resumes_into_the_uninterrupted_run(tiny_model_path, tmp_path, script):
    """SIGTERM while the initial policy is evaluated (1000 problems; the handler is in place right after the plan
    line): the run logs row 0 and checkpoints update 0, before AdamW's first step. The resumed run does not log row 0
    again, its first AdamW step is the optimizer's first (the checkpoint holds no optimizer state), and it equals the
    uninterrupted run bit for bit. (dapo.py samples without dynamic sampling: no tiny-model group of 2-digit sums has
    a reward spread.)"""
    flags = ["--model", tiny_model_path, *FAST, *EXTRA.get(script, []), "--digits", "2", "--eval-size", "1000"]
    flags += ["--no-dynamic-sampling"] if script == "dapo.py" else []
    flags += ["--eval-every", "3", "--total-updates", "3"]
    run_script(script, *flags, "--run-name", "full", cwd=tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "algorithms" / script), *flags, "--run-name", "z"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("plan:"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    ck = torch.load(tmp_path / "runs" / "z" / "checkpoint.pt", weights_only=False)
    assert ck["update"] == 0 and ck["optimizer"]["state"] == {}
    assert [r["global_step"] for r in metrics_of(tmp_path, "z")] == [0]
    run_script(script, "--resume", str(tmp_path / "runs" / "z"), cwd=tmp_path)
    full = comparable(metrics_of(tmp_path, "full"))
    assert_same_run(comparable(metrics_of(tmp_path, "z")), full)
    assert [r["global_step"] for r in full] == [0, 1, 2, 3]


def test_failed_checkpoint_write_ends_the_run_and_keeps_the_previous_one(tiny_model_path, tmp_path):
    """A directory where the temporary file should go makes torch.save fail (as a full disk would; root ignores
    read-only permissions, so the test blocks the path instead)."""
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "2",
        "--eval-every",
        "0",
        "--keep-final-state",
        "--run-name",
        "w",
        cwd=tmp_path,
    )
    (tmp_path / "runs" / "w" / "checkpoint.pt.tmp").mkdir()
    proc = run_script(
        "grpo.py", "--resume", str(tmp_path / "runs" / "w"), "--total-updates", "3", cwd=tmp_path, check=False
    )
    assert proc.returncode == 1
    assert "could not write the checkpoint" in proc.stderr and "the previous checkpoint" in proc.stderr
    assert "is intact" in proc.stderr and "Traceback" not in proc.stderr
    assert torch.load(tmp_path / "runs" / "w" / "checkpoint.pt", weights_only=False)["update"] == 2
