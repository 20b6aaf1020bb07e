"""vineppo.py end to end on the tiny test model: every metric for both value estimators, the MC rollout count,
exact staleness with MC values from the behaviour policy, on-policy invariants, the ratio guard, resume, errors."""

import pytest
import torch

from common.models import load_model
from conftest import FAST, assert_same_run, comparable, metrics_of, run_script

pytestmark = pytest.mark.run

SHARED_KEYS = [
    "charts/reward_mean",
    "charts/accuracy",
    "charts/response_length_mean",
    "charts/truncated_frac",
    "charts/learning_rate",
    "charts/tokens_per_sec",
    "charts/gen_tokens_per_sec",
    "charts/train_tokens_per_sec",
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
VINE_KEYS = [
    "time/mc_rollout",
    "vineppo/mc_rollouts",
    "vineppo/mc_states",
    "vineppo/mc_time_frac",
    "vineppo/value_mean",
    "vineppo/value_std",
    "vineppo/nonzero_adv_frac",
    "vineppo/steps_per_response",
    "vineppo/skipped_batches",
]
K = 3


def train_rows(tmp_path, name):
    return [r for r in metrics_of(tmp_path, name) if "losses/policy_loss" in r]


def test_mc_smoke_logs_every_metric_and_counts_k_rollouts_per_state(tiny_model_path, tmp_path):
    proc = run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--total-updates",
        "3",
        "--run-name",
        "mc",
        cwd=tmp_path,
    )
    assert "done: 3 updates" in proc.stdout
    rows = metrics_of(tmp_path, "mc")
    assert rows[0]["global_step"] == 0 and "eval/accuracy" in rows[0]
    train = train_rows(tmp_path, "mc")
    assert [r["global_step"] for r in train] == [1, 2, 3]
    for key in SHARED_KEYS + VINE_KEYS + ["vineppo/mc_staleness", "vineppo/mc_cut_frac", "async/logprob_diff"]:
        assert all(key in r for r in train), key
    for r in train:
        assert r["vineppo/mc_rollouts"] == K * r["vineppo/mc_states"]
        assert r["vineppo/mc_states"] >= 2  # at least the two prompt states (a group shares its prompt state)
        assert r["vineppo/steps_per_response"] >= 1 and 0 <= r["vineppo/nonzero_adv_frac"] <= 1
        assert 0 <= r["vineppo/value_mean"] <= 1 and r["vineppo/skipped_batches"] == 0
    # with the cap at 0 steps only the prompt states remain: one per prompt, K rollouts each
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--max-steps",
        "0",
        "--total-updates",
        "2",
        "--eval-every",
        "0",
        "--run-name",
        "cap0",
        cwd=tmp_path,
    )
    assert all(r["vineppo/mc_states"] == 2 and r["vineppo/mc_rollouts"] == 2 * K for r in train_rows(tmp_path, "cap0"))


def test_truncated_trajectories_and_mc_rollouts_score_zero(tiny_model_path, tmp_path):
    """With one new token a finished response or completion is EOS alone (empty text, reward 0) and any other is cut
    at the limit: unfinished, reward 0 as in the authors' code, even where the verifier would accept "7"."""
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--max-new-tokens",
        "1",
        "--prompts-per-batch",
        "8",
        "--total-updates",
        "2",
        "--eval-every",
        "0",
        "--run-name",
        "cut",
        cwd=tmp_path,
    )  # the verifier alone scores 0.125 and 0.04 here: some cut answers are right
    train = train_rows(tmp_path, "cut")
    assert all(r["charts/reward_mean"] == 0 and r["vineppo/value_mean"] == 0 for r in train)
    assert any(r["charts/truncated_frac"] > 0 for r in train)


def test_full_mc_budget_runs_and_logs_the_cut_fraction(tiny_model_path, tmp_path):
    """--mc-budget full gives every MC completion max_new_tokens fresh tokens, and logs vineppo/mc_cut_frac like the
    default. The tiny model's responses are one step, so every valued state is a prompt (b = 0), where the two
    budgets coincide: the runs are then the same run bit for bit (the flag changes nothing but the budget; the
    budget rule itself: test_vineppo_loss.py), and with two new tokens some completions are cut."""
    flags = [*FAST, "--mc-samples", str(K), "--max-new-tokens", "2", "--total-updates", "2", "--eval-every", "0"]
    for mode in ("remaining", "full"):
        run_script(
            "vineppo.py", "--model", tiny_model_path, *flags, "--mc-budget", mode, "--run-name", mode, cwd=tmp_path
        )
    remaining, full = train_rows(tmp_path, "remaining"), train_rows(tmp_path, "full")
    assert all(r["vineppo/steps_per_response"] == 1 and 0 < r["vineppo/mc_cut_frac"] <= 1 for r in full)
    assert_same_run(comparable(remaining), comparable(full))


def test_critic_smoke_logs_value_loss_and_saves_the_critic(tiny_model_path, tmp_path):
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--value-estimator",
        "critic",
        "--total-updates",
        "3",
        "--critic-head-learning-rate",
        "1e-2",
        "--keep-final-state",
        "--run-name",
        "critic",
        cwd=tmp_path,
    )
    train = train_rows(tmp_path, "critic")
    for key in SHARED_KEYS + VINE_KEYS + ["losses/value_loss"]:
        assert all(key in r for r in train), key
    assert all(r["vineppo/mc_rollouts"] == 0 and "vineppo/mc_cut_frac" not in r for r in train)  # no MC rollouts
    assert train[0]["vineppo/value_mean"] == 0.0  # zero-initialised head
    assert any(r["charts/reward_mean"] > 0 for r in train)  # some target differs from the initial value 0 ...
    ck = torch.load(tmp_path / "runs" / "critic" / "checkpoint.pt", weights_only=False)
    assert "head.weight" in ck["critic"] and any(k.startswith("lm.") for k in ck["critic"])
    assert ck["critic"]["head.bias"].abs().sum() > 0  # ... so the saved critic has trained


def test_exact_staleness_with_mc_values_from_the_behaviour_policy(tiny_model_path, tmp_path):
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--total-updates",
        "5",
        "--staleness",
        "2",
        "--eval-every",
        "0",
        "--learning-rate",
        "1e-3",
        "--run-name",
        "s2",
        cwd=tmp_path,
    )
    rows = train_rows(tmp_path, "s2")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    # the MC values of every batch were computed by the version that generated the batch
    assert [r["vineppo/mc_staleness"] for r in rows] == [r["async/staleness_mean"] for r in rows]
    # two epochs per batch: the lag clock counts both passes (batch k is generated by version 2k - 2)
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--total-updates",
        "6",
        "--staleness",
        "2",
        "--epochs",
        "2",
        "--eval-every",
        "0",
        "--run-name",
        "e2",
        cwd=tmp_path,
    )
    rows = train_rows(tmp_path, "e2")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 3, 2, 3]
    assert [r["vineppo/mc_staleness"] for r in rows] == [r["async/staleness_mean"] for r in rows]


def test_on_policy_fp32_ratio_is_one_and_clip_never_fires(tiny_model_path, tmp_path):
    exact = ["--no-bf16", "--engine-dtype", "float32", "--learning-rate", "1e-3", "--total-updates", "3"]
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        *exact,
        "--mc-samples",
        str(K),
        "--eval-every",
        "0",
        "--run-name",
        "fp32",
        cwd=tmp_path,
    )
    rows = train_rows(tmp_path, "fp32")
    assert any(r["losses/grad_norm"] > 0 for r in rows)
    assert all(r["losses/clipfrac"] == 0 and abs(r["losses/ratio_mean"] - 1) < 1e-4 for r in rows)
    assert all(r["async/logprob_diff"] < 1e-4 for r in rows)


def test_ratio_guard_skips_updates_and_counts_them(tiny_model_path, tmp_path):
    """A guard below the on-policy mean ratio (~1) trips on every update: nothing is trained, every skip counted."""
    run_script(
        "vineppo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--total-updates",
        "3",
        "--ratio-guard",
        "0.5",
        "--learning-rate",
        "1e-2",
        "--eval-every",
        "0",
        "--keep-final-state",
        "--run-name",
        "g",
        cwd=tmp_path,
    )
    assert [r["vineppo/skipped_batches"] for r in train_rows(tmp_path, "g")] == [1, 2, 3]
    ck = torch.load(tmp_path / "runs" / "g" / "checkpoint.pt", weights_only=False)
    before = load_model(tiny_model_path).state_dict()
    assert all(torch.equal(t, before[n]) for n, t in ck["model"].items())


@pytest.mark.parametrize("estimator", ["mc", "critic"])
def test_resume_reproduces_uninterrupted_run(tiny_model_path, tmp_path, estimator):
    common = [
        "--model",
        tiny_model_path,
        *FAST,
        "--mc-samples",
        str(K),
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--learning-rate",
        "1e-2",
        "--value-estimator",
        estimator,
        "--eval-every",
        "0",
    ]
    run_script("vineppo.py", *common, "--total-updates", "6", "--run-name", "full", cwd=tmp_path)
    part = run_script(
        "vineppo.py",
        *common,
        "--total-updates",
        "6",
        "--debug-interrupt-at",
        "3",
        "--run-name",
        "part",
        cwd=tmp_path,
        check=False,
    )  # interrupted mid-batch
    assert part.returncode == 130, part.stderr[-2000:]
    run_script("vineppo.py", "--resume", str(tmp_path / "runs" / "part"), cwd=tmp_path)

    full = comparable(metrics_of(tmp_path, "full"))
    assert_same_run(comparable(metrics_of(tmp_path, "part")), full)
    assert any(r["losses/grad_norm"] > 0 for r in full[1:])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mc-samples", "0"], "--mc-samples"),
        (["--max-steps", "-1"], "--max-steps (the authors' GSM8K cap: 25) >= 0"),
        (["--ratio-guard", "0"], "--ratio-guard must be > 0"),
        (["--staleness", "-1"], "--staleness must be >= 0"),
        (["--value-estimator", "gae"], "value-estimator"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model_path, tmp_path, flags, message):
    proc = run_script("vineppo.py", "--model", tiny_model_path, *FAST, *flags, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr[-2000:]
