"""dapo.py end to end on the tiny test model: metrics, exact staleness, dynamic sampling's bookkeeping and its
round limit, overlong filtering, resume, and equivalence with grpo.py when every DAPO technique is off."""

import pytest
import torch

from conftest import FAST, assert_same_run, comparable, metrics_of, run_script

pytestmark = pytest.mark.run

DAPO_KEYS = [
    "dapo/groups_generated",
    "dapo/groups_kept",
    "dapo/sampling_rounds",
    "dapo/overlong_filtered_frac",
    "dapo/overlong_penalty_mean",
    "async/dropped_samples",
]
P, G = 2, 4  # FAST's prompts per batch and group size
ROUNDS = ["--max-sampling-rounds", "50"]  # the tiny model rarely has a reward spread: room to fill each batch


def train_rows(tmp_path, name):
    return [r for r in metrics_of(tmp_path, name) if "losses/policy_loss" in r]


def test_smoke_with_staleness_logs_dynamic_sampling(tiny_model_path, tmp_path):
    proc = run_script(
        "dapo.py",
        "--model",
        tiny_model_path,
        *FAST,
        *ROUNDS,
        "--total-updates",
        "6",
        "--staleness",
        "3",
        "--run-name",
        "s3",
        cwd=tmp_path,
    )
    assert "filling: batch 4 of 4" in proc.stdout
    rows = train_rows(tmp_path, "s3")
    assert [r["async/staleness_mean"] for r in rows] == [0, 1, 2, 3, 3, 3]
    for r in rows:
        assert all(key in r for key in DAPO_KEYS)
        assert r["dapo/groups_kept"] >= P  # the batch was filled with groups that have a reward spread
        assert r["dapo/groups_generated"] == r["dapo/sampling_rounds"] * 2 * P  # --oversample 2
        assert r["async/dropped_samples"] == (r["dapo/groups_generated"] - P) * G  # every dropped sample counted
        assert 0 < r["charts/accuracy"] < 1  # kept groups are neither all right nor all wrong
    assert any("eval/accuracy" in r for r in metrics_of(tmp_path, "s3"))


def test_every_technique_off_is_grpo(tiny_model_path, tmp_path):
    """No clip-higher, no dynamic sampling, sequence-mean loss, no shaping: the +-1 reward's z-scores equal the
    0/1 reward's (up to the std epsilon), so the updates are GRPO's with the same data."""
    common = [
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "4",
        "--staleness",
        "1",
        "--engine-dtype",
        "float32",
        "--no-bf16",
    ]
    run_script("grpo.py", *common, "--loss-agg", "seq-mean-token-mean", "--run-name", "grpo", cwd=tmp_path)
    run_script(
        "dapo.py",
        *common,
        "--no-clip-higher",
        "--no-dynamic-sampling",
        "--no-token-level-loss",
        "--no-overlong-shaping",
        "--run-name",
        "dapo",
        cwd=tmp_path,
    )
    grpo, dapo = train_rows(tmp_path, "grpo"), train_rows(tmp_path, "dapo")
    for a, b in zip(grpo, dapo):
        assert a["charts/accuracy"] == b["charts/accuracy"]
        assert b["charts/reward_mean"] == pytest.approx(2 * a["charts/reward_mean"] - 1)
        assert b["losses/policy_loss"] == pytest.approx(a["losses/policy_loss"], abs=1e-4)
        assert b["losses/clipfrac"] == a["losses/clipfrac"]
        assert b["async/dropped_samples"] == 0 and b["dapo/groups_generated"] == P


@pytest.mark.parametrize("staleness", ["0", "2"])
def test_running_out_of_sampling_rounds_checkpoints_and_a_resume_may_raise_them(tiny_model_path, tmp_path, staleness):
    """With this seed batches 0-2 need 4, 5 and 6 sampling rounds: --max-sampling-rounds 5 stops the run at batch 2
    with one line saying what to do, after the trainer's current update, with a checkpoint (at a lag the producer
    is ahead: the queued batches are saved). --resume with --max-sampling-rounds 50 regenerates batch 2 from the
    same place in the prompt stream, and the run equals one that had 50 from the start (a batch that fits in the
    rounds is the same under any limit)."""
    flags = ["--model", tiny_model_path, *FAST, "--staleness", staleness, "--total-updates", "5"]
    run_script("dapo.py", *flags, *ROUNDS, "--run-name", "full", cwd=tmp_path)
    assert [r["dapo/sampling_rounds"] for r in train_rows(tmp_path, "full")][:3] == [4, 5, 6]
    proc = run_script("dapo.py", *flags, "--max-sampling-rounds", "5", "--run-name", "c5", cwd=tmp_path, check=False)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = "dynamic sampling: 1 of 2 groups with a reward spread for batch 2 after 5 rounds (20 groups): resume with a "
    assert line + "larger --max-sampling-rounds" in proc.stdout
    ck = torch.load(tmp_path / "runs" / "c5" / "checkpoint.pt", weights_only=False)
    assert ck["update"] <= 2 and ck["next_k"] == 2  # batch 2 is generated again on resume
    assert [r["global_step"] for r in train_rows(tmp_path, "c5")] == list(range(1, ck["update"] + 1))
    refused = run_script(
        "dapo.py", "--resume", str(tmp_path / "runs" / "c5"), "--oversample", "3", cwd=tmp_path, check=False
    )
    assert refused.returncode == 1 and "--oversample 3 (the checkpoint's: 2)" in refused.stderr
    assert "start a new run" in refused.stderr and "--max-sampling-rounds" in refused.stderr
    run_script("dapo.py", "--resume", str(tmp_path / "runs" / "c5"), "--max-sampling-rounds", "50", cwd=tmp_path)
    assert_same_run(comparable(metrics_of(tmp_path, "c5")), comparable(metrics_of(tmp_path, "full")))


def test_overlong_filtering_masks_truncated_samples(tiny_model_path, tmp_path):
    short = [*FAST, "--max-new-tokens", "2", "--overlong-buffer", "1"]  # most responses are cut at 2 tokens
    run_script(
        "dapo.py",
        "--model",
        tiny_model_path,
        *short,
        "--total-updates",
        "3",
        "--overlong-filtering",
        "--no-dynamic-sampling",
        "--run-name",
        "filt",
        cwd=tmp_path,
    )
    rows = train_rows(tmp_path, "filt")
    assert any(r["dapo/overlong_filtered_frac"] > 0 for r in rows)
    assert all(r["dapo/overlong_filtered_frac"] == r["charts/truncated_frac"] for r in rows)
    for r in rows:
        if r["dapo/overlong_filtered_frac"] == 1.0:
            assert r["losses/policy_loss"] == 0.0 and r["losses/clipfrac"] == 0.0
    assert all(r["dapo/overlong_penalty_mean"] < 0 for r in rows if r["charts/truncated_frac"] > 0)


def test_resume_reproduces_uninterrupted_run(tiny_model_path, tmp_path):
    common = ["--model", tiny_model_path, *FAST, *ROUNDS, "--staleness", "2", "--updates-per-batch", "2"]
    run_script("dapo.py", *common, "--total-updates", "6", "--run-name", "full", cwd=tmp_path)
    part = run_script(
        "dapo.py",
        *common,
        "--total-updates",
        "6",
        "--debug-interrupt-at",
        "3",
        "--run-name",
        "part",
        cwd=tmp_path,
        check=False,
    )
    assert part.returncode == 130, part.stderr[-2000:]
    run_script("dapo.py", "--resume", str(tmp_path / "runs" / "part"), cwd=tmp_path)
    resumed, full = comparable(metrics_of(tmp_path, "part")), comparable(metrics_of(tmp_path, "full"))
    assert_same_run(resumed, full)  # includes the dynamic-sampling prompt stream position


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--overlong-buffer", "0"], "--overlong-buffer"),
        (["--overlong-buffer", "6"], "--overlong-buffer"),
        (["--oversample", "0"], "--oversample"),
        (["--clip-eps-high", "0"], "--clip-eps-high"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model_path, tmp_path, flags, message):
    proc = run_script("dapo.py", "--model", tiny_model_path, *FAST, *flags, cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr
