"""ppo_stale.py end to end on the tiny test model: metrics and the proximal pass on-policy, exact lag, naive PPO
(= grpo.py), and AReaL's bounded mode: the staleness bound, eta = 0 is synchronous, resume, bad input."""

import pytest
import torch

from conftest import FAST, assert_same_run, comparable, metrics_of, run_script

pytestmark = pytest.mark.run

PPO_KEYS = [
    "losses/behav_weight_mean",
    "losses/behav_weight_max",
    "losses/behav_capped_frac",
    "losses/prox_ratio_mean",
    "losses/prox_ratio_max",
]
GRPO_KEYS = [
    "charts/reward_mean",
    "charts/accuracy",
    "charts/response_length_mean",
    "charts/truncated_frac",
    "charts/learning_rate",
    "charts/tokens_per_sec",
    "losses/policy_loss",
    "losses/kl",
    "losses/entropy",
    "losses/clipfrac",
    "losses/approx_kl",
    "losses/ratio_mean",
    "losses/ratio_max",
    "losses/grad_norm",
    "async/staleness_mean",
    "async/staleness_max",
    "async/policy_version",
    "async/queue_size",
    "async/dropped_samples",
    "time/rollout",
    "time/train_step",
    "time/weight_sync",
    "time/trainer_wait",
    "time/producer_wait",
]


def train_rows(tmp_path, name):
    return [r for r in metrics_of(tmp_path, name) if "losses/policy_loss" in r]


def test_default_run_logs_every_metric_and_the_prox_pass_is_exact_on_policy(tiny_model_path, tmp_path):
    """On-policy with one update per batch the proximal weights are the current weights: u = 1 exactly, no clipping,
    even though the bf16 engine and the trainer disagree slightly (that mismatch goes into w)."""
    proc = run_script(
        "ppo_stale.py", "--model", tiny_model_path, *FAST, "--total-updates", "3", "--run-name", "d", cwd=tmp_path
    )
    assert "done: 3 updates" in proc.stdout and "decoupled PPO" in proc.stdout
    rows = train_rows(tmp_path, "d")
    assert [r["global_step"] for r in rows] == [1, 2, 3]
    for key in (
        GRPO_KEYS
        + PPO_KEYS
        + ["time/prox_pass", "async/logprob_diff", "async/start_lag_max", "async/version_span_mean"]
    ):
        assert all(key in r for r in rows), key
    for r in rows:
        assert r["losses/prox_ratio_mean"] == pytest.approx(1.0, abs=1e-7) and r["losses/prox_ratio_max"] == 1.0
        assert r["losses/clipfrac"] == 0 and r["losses/behav_capped_frac"] == 0
        assert r["async/staleness_max"] == 0 and r["time/prox_pass"] > 0
        assert abs(r["losses/behav_weight_mean"] - 1) < 0.1  # bf16 engine vs trainer


def test_exact_lag_staleness_3(tiny_model_path, tmp_path):
    proc = run_script(
        "ppo_stale.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "6",
        "--staleness",
        "3",
        "--learning-rate",
        "1e-2",
        "--eval-every",
        "0",
        "--run-name",
        "s3",
        cwd=tmp_path,
    )
    assert "filling: batch 4 of 4" in proc.stdout
    rows = train_rows(tmp_path, "s3")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 3, 3, 3]
    assert all(r["async/staleness_mean"] == r["async/staleness_max"] for r in rows)
    assert all(r["async/version_span_mean"] == 0 for r in rows)
    # U = 1: the proximal policy is the current one (u = 1); the stale data shows in the behaviour weight
    assert all(r["losses/prox_ratio_max"] == 1.0 and r["losses/clipfrac"] == 0 for r in rows)
    assert any(abs(r["losses/behav_weight_mean"] - 1) > 1e-2 for r in rows[3:])


def test_no_decoupled_is_grpo(tiny_model_path, tmp_path):
    """Naive PPO against the behaviour policy, group advantages, exact lag: the same run as grpo.py."""
    flags = [
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "6",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--learning-rate",
        "1e-2",
    ]
    run_script("ppo_stale.py", *flags, "--no-decoupled", "--run-name", "naive", cwd=tmp_path)
    run_script("grpo.py", *flags, "--run-name", "grpo", cwd=tmp_path)
    naive, grpo = metrics_of(tmp_path, "naive"), metrics_of(tmp_path, "grpo")
    assert len(naive) == len(grpo) and any(r.get("losses/grad_norm", 0) > 0 for r in grpo)
    for a in naive:
        assert not any(key in a for key in PPO_KEYS) and a.get("time/prox_pass", 0) == 0
    grpo = comparable(grpo)  # naive PPO's extra keys (its version bookkeeping) are not grpo.py's
    assert_same_run([{key: a[key] for key in b} for a, b in zip(naive, grpo)], grpo)


@pytest.mark.parametrize("eta,U", [(1, 2), (2, 1)])
def test_bounded_mode_never_exceeds_the_bound(tiny_model_path, tmp_path, eta, U):
    """Every sample of batch k started at a version >= (k - eta) U, so at minibatch m of the batch (update kU + m)
    a token is at most eta U + m updates stale; the producer does run ahead (generation is fast here)."""
    proc = run_script(
        "ppo_stale.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "6",
        "--max-staleness",
        str(eta),
        "--updates-per-batch",
        str(U),
        "--adv-norm",
        "batch",
        "--run-name",
        "b",
        cwd=tmp_path,
    )
    assert "not deterministic" in proc.stdout
    rows = train_rows(tmp_path, "b")
    assert [r["global_step"] for r in rows] == list(range(1, 7))
    for r in rows:
        k, m = divmod(r["global_step"] - 1, U)
        assert 0 <= r["async/start_lag_max"] <= eta * U
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= eta * U + m
        assert r["async/staleness_max"] <= r["async/start_lag_max"] + m
    assert max(r["async/staleness_max"] for r in rows) >= 1


def test_bounded_eta_0_is_synchronous(tiny_model_path, tmp_path):
    """eta = 0: batch k starts only after the trainer finished batch k - 1 and nothing lands during its generation,
    so every token is sampled by version kU (staleness m at minibatch m) and the run equals --staleness 0."""
    flags = [
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "6",
        "--updates-per-batch",
        "2",
        "--learning-rate",
        "1e-2",
    ]
    run_script("ppo_stale.py", *flags, "--max-staleness", "0", "--run-name", "eta0", cwd=tmp_path)
    run_script("ppo_stale.py", *flags, "--staleness", "0", "--run-name", "s0", cwd=tmp_path)
    rows = train_rows(tmp_path, "eta0")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 0, 1, 0, 1]
    assert all(r["async/start_lag_max"] == 0 and r["async/version_span_mean"] == 0 for r in rows)
    eta0, s0 = metrics_of(tmp_path, "eta0"), metrics_of(tmp_path, "s0")
    assert any(r.get("losses/grad_norm", 0) > 0 for r in s0)
    s0 = comparable(s0)
    assert_same_run([{key: a[key] for key in b} for a, b in zip(eta0, s0)], s0)


def test_exact_lag_resume_reproduces_uninterrupted_run(tiny_model_path, tmp_path):
    """Interrupted mid-batch: the resumed run keeps the batch's proximal log-probs (taken before its first update)."""
    common = [
        "--model",
        tiny_model_path,
        *FAST,
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--learning-rate",
        "1e-2",
    ]
    run_script("ppo_stale.py", *common, "--total-updates", "6", "--run-name", "full", cwd=tmp_path)
    part = run_script(
        "ppo_stale.py",
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
    ck = torch.load(tmp_path / "runs" / "part" / "checkpoint.pt", weights_only=False)
    assert ck["update"] == 3 and "prox" in ck["rollouts"][0]
    run_script("ppo_stale.py", "--resume", str(tmp_path / "runs" / "part"), cwd=tmp_path)
    resumed, full = comparable(metrics_of(tmp_path, "part")), comparable(metrics_of(tmp_path, "full"))
    assert_same_run(resumed, full)
    assert any(r["losses/prox_ratio_max"] != 1.0 for r in full[1:] if "losses/prox_ratio_max" in r)  # U = 2: u moves


def test_weights_are_kept_only_while_the_producer_can_use_them(tiny_model_path, tmp_path):
    """Exact lag: payloads only for the versions batches are generated by; bounded: at most the newest one."""
    run_script(
        "ppo_stale.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--staleness",
        "3",
        "--eval-every",
        "0",
        "--total-updates",
        "6",
        "--keep-final-state",
        "--run-name",
        "s3",
        cwd=tmp_path,
    )
    assert torch.load(tmp_path / "runs" / "s3" / "checkpoint.pt", weights_only=False)["pending_weights"] == []
    run_script(
        "ppo_stale.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--max-staleness",
        "2",
        "--eval-every",
        "0",
        "--total-updates",
        "6",
        "--keep-final-state",
        "--run-name",
        "b2",
        cwd=tmp_path,
    )
    assert len(torch.load(tmp_path / "runs" / "b2" / "checkpoint.pt", weights_only=False)["pending_weights"]) <= 1


def test_bounded_mode_resumes(tiny_model_path, tmp_path):
    flags = ["--model", tiny_model_path, *FAST, "--max-staleness", "1"]
    run_script("ppo_stale.py", *flags, "--total-updates", "3", "--keep-final-state", "--run-name", "r", cwd=tmp_path)
    run_script("ppo_stale.py", "--resume", str(tmp_path / "runs" / "r"), "--total-updates", "6", cwd=tmp_path)
    rows = train_rows(tmp_path, "r")
    assert [r["global_step"] for r in rows] == list(range(1, 7))
    assert all(r["async/start_lag_max"] <= 1 and r["async/staleness_max"] <= 1 for r in rows)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
        (["--max-staleness", "1", "--staleness", "2"], "pass only one of them"),
        (["--behav-weight-cap", "1.0"], "--behav-weight-cap must be > 1"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model_path, tmp_path, flags, message):
    proc = run_script("ppo_stale.py", "--model", tiny_model_path, *FAST, *flags, cwd=tmp_path, check=False)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
