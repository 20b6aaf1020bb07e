"""Runs that survive faults, end to end on the tiny Llama: non-finite steps skipped (every script), a SIGKILL after a
safety checkpoint resumed into the uninterrupted run, SIGTERM handled like Ctrl-C, a failed checkpoint or metrics
write; run folders that are not overwritten, shared or recreated elsewhere; bad input refused in one line."""

import importlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

from common.models import load_model
from conftest import FAST, ROOT, assert_same_run, comparable, metrics_of, run_script

pytestmark = pytest.mark.run

EXTRA = {"dapo.py": ["--max-sampling-rounds", "50"], "vineppo.py": ["--mc-samples", "2"]}  # each script's fast settings


@pytest.mark.parametrize("script", ["grpo.py", "dapo.py", "m2po.py", "dppo.py", "ppo_stale.py", "tba.py", "vineppo.py"])
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
    assert (tmp_path / "runs" / "killed" / ".lock").exists()  # left by the killed process, locked by none
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
    files = snapshot(tmp_path)
    again = run_script("grpo.py", *flags, "--run-name", "safe", cwd=tmp_path, check=False)  # the same name again
    assert again.returncode == 1 and again.stderr.strip() == (
        f"{os.path.join('runs', 'safe')} already holds a run (metrics.jsonl, model): pick another --run-name."
    )
    assert snapshot(tmp_path) == files  # its metrics, config and model as they were
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


SCRIPTS = sorted(p.name for p in (ROOT / "algorithms").glob("*.py"))  # every script


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


def snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes (and every folder): what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def start_run(*flags: str, cwd) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "algorithms" / "grpo.py"), *flags],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_run_folder_has_one_run_at_a_time_and_a_moved_run_resumes_where_it_is(tiny_model_path, tmp_path):
    """A second run under a running run's name is refused before it builds anything; the first run, stopped by
    SIGTERM, moved from runs/A to runs/B and resumed there, continues in runs/B under the name B and says where."""
    flags = ["--model", tiny_model_path, *FAST, "--eval-every", "0"]
    proc = start_run(*flags, "--total-updates", "400", "--run-name", "A", cwd=tmp_path)
    for line in proc.stdout:
        if "] 2/400" in line:
            break
    second = run_script("grpo.py", *flags, "--total-updates", "3", "--run-name", "A", cwd=tmp_path, check=False)
    assert second.returncode == 1 and second.stderr.strip() == (
        f"{os.path.join('runs', 'A')} is in use by another run (process {proc.pid}); pick another --run-name, or "
        f"wait for it to end."
    )
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    update = torch.load(tmp_path / "runs" / "A" / "checkpoint.pt", weights_only=False)["update"]
    shutil.move(tmp_path / "runs" / "A", tmp_path / "runs" / "B")
    assert sorted(os.listdir(tmp_path / "runs" / "B")) == ["checkpoint.pt", "config.json", "metrics.jsonl"]
    resumed = run_script("grpo.py", "--resume", "runs/B", "--total-updates", str(update + 1), cwd=tmp_path)
    assert f"resumed at update {update}: the run continues in {os.path.join('runs', 'B')}\n" in resumed.stdout
    assert "[B] arithmetic" in resumed.stdout and os.listdir(tmp_path / "runs") == ["B"]  # runs/A is not made again
    steps = [r["global_step"] for r in metrics_of(tmp_path, "B") if "losses/policy_loss" in r]
    assert steps == list(range(1, update + 2))
    assert json.loads((tmp_path / "runs" / "B" / "config.json").read_text())["run_name"] == "B"
    assert sorted(os.listdir(tmp_path / "runs" / "B")) == ["config.json", "metrics.jsonl", "model"]


def test_a_failed_metrics_write_ends_the_run_with_whole_rows(tiny_model_path, tmp_path):
    """The process may write files of at most 16 KB (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past it fails
    with EFBIG, as on a full disk): metrics.jsonl fills up a few updates in, part of a row written."""
    limit = 16_000
    proc = subprocess.run(
        [sys.executable, str(ROOT / "algorithms" / "grpo.py"), "--model", tiny_model_path, *FAST]
        + ["--total-updates", "40", "--eval-every", "0", "--run-name", "full"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    path = tmp_path / "runs" / "full" / "metrics.jsonl"
    steps = [json.loads(line)["global_step"] for line in path.read_text().splitlines()]  # every line whole
    assert 1 < len(steps) < 40 and steps == list(range(1, len(steps) + 1))
    assert "Traceback" not in proc.stderr  # transformers' progress bars go to stderr before it
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"could not write {path.relative_to(tmp_path)} (File too large); it holds every row before update "
        f"{len(steps) + 1}, whole. Free disk space; --resume {os.path.join('runs', 'full')} continues from the run's "
        f"last checkpoint, if it wrote one."
    )
    assert path.stat().st_size + 2_000 > limit  # it failed for want of room


def test_ctrl_c_during_start_up_is_one_line_and_leaves_no_folder(default_tokenizer_path, tmp_path):
    """SIGINT once the run folder is made, while the 135M default model loads: no traceback, exit status 130, and
    the folder, empty, goes."""
    proc = start_run("--model", default_tokenizer_path, *FAST, "--run-name", "early", cwd=tmp_path)
    lock, t0 = tmp_path / "runs" / "early" / ".lock", time.time()
    while not lock.exists() and proc.poll() is None and time.time() - t0 < 120:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted during start-up, before any update: nothing to save"
    assert not (tmp_path / "runs").exists()


def bad_checkpoint(tmp_path, kind: str) -> None:
    """runs/x/checkpoint.pt: empty, cut short, or written by m2po.py."""
    path = tmp_path / "runs" / "x" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    if kind == "m2po":
        torch.save({"args": asdict(importlib.import_module("m2po").Args()), "update": 1}, path)
    else:
        torch.save({"args": {"seed": 1}, "update": 1, "w": torch.zeros(10_000)}, path)
        path.write_bytes(path.read_bytes()[: 20_000 if kind == "truncated" else 0])


@pytest.mark.parametrize(
    "case,flags,message",
    [
        ("empty", ["--resume", "runs/x"], "--resume runs/x/checkpoint.pt: not a readable checkpoint (0 bytes; "),
        ("truncated", ["--resume", "runs/x"], "--resume runs/x/checkpoint.pt: not a readable checkpoint (20000 "),
        ("m2po", ["--resume", "runs/x"], "--resume runs/x: written by m2po.py, whose settings ("),
        ("run folder as --model", ["--model", "runs/x"], "--model runs/x: its config.json is not a model's"),
        ("read-only working folder", [], "cannot make the run folder runs/r ("),
        ("offline hub", ["--task", "gsm8k"], "could not load gsm8k from the hub (openai/gsm8k, split train: offline, "),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(tiny_model_path, tmp_path, monkeypatch, case, flags, message):
    if case in ("empty", "truncated", "m2po"):
        bad_checkpoint(tmp_path, case)
    if case == "run folder as --model":
        (tmp_path / "runs" / "x").mkdir(parents=True)
        (tmp_path / "runs" / "x" / "config.json").write_text(json.dumps({"seed": 1}))
    if case == "read-only working folder":  # root writes anywhere: a file where runs/ should go blocks it the same
        (tmp_path / "runs").write_text("")
    if case == "offline hub":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path.with_name(tmp_path.name + "-hf")))  # no cached copy
    files = snapshot(tmp_path)
    model = [] if "--model" in flags else ["--model", tiny_model_path]
    proc = run_script("grpo.py", *model, *FAST, *flags, "--run-name", "r", cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert snapshot(tmp_path) == files  # nothing made, nothing changed
