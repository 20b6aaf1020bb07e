"""GRPO's pure functions against independent re-computations of the formulas (DeepSeekMath sec. 4.1).

The loss helpers every script keeps its own copy of (group_advantages, clipped_surrogate, k3_kl, aggregate) are tested
here on each copy (``own_copies``: the scripts that define the function); a copy that differs on purpose (dapo.py's
clip-higher surrogate, vineppo.py's clamped k3) is tested in its script's own test file.
"""

import math

import numpy as np
import pytest
import torch

from conftest import own_copies
from grpo import batch_version, default_eval_every, default_updates, run_plan

GROUP_ADVANTAGES = own_copies("group_advantages")
CLIPPED_SURROGATE = own_copies("clipped_surrogate", besides=("dapo",))  # dapo: eps_low / eps_high, test_dapo_loss.py
K3_KL = own_copies("k3_kl", besides=("vineppo",))  # vineppo clamps the value to [0, 10]: test_vineppo_loss.py
AGGREGATE = own_copies("aggregate")


@pytest.mark.parametrize("group_advantages", GROUP_ADVANTAGES)
def test_group_advantages_match_numpy_zscore(group_advantages):
    r = np.array([[1, 0, 0, 1, 1, 0, 0, 0], [0.5, 0.25, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    got = group_advantages(torch.tensor(r, dtype=torch.float32), scale_std=True, eps=1e-6)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group_advantages", GROUP_ADVANTAGES)
def test_group_advantages_add_eps_to_the_std_not_inside_the_square_root(group_advantages):
    """DeepSeekMath eq. 4 as verl computes it: (R - mean) / (std + eps). A large eps, and a near-constant group whose
    std is small next to eps, tell it from (R - mean) / sqrt(var + eps) (with eps 1e-6 and 0/1 rewards the two agree
    to 1e-12)."""
    r = np.array([[1, 0, 0, 1, 1, 0, 0, 0], [0.5] * 7 + [0.501]])
    for eps in (1e-6, 0.5):
        expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)
        got = group_advantages(torch.tensor(r, dtype=torch.float64), scale_std=True, eps=eps)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("group_advantages", GROUP_ADVANTAGES)
def test_group_advantages_all_equal_rewards_are_zero(group_advantages):
    for value in (0.0, 1.0):
        got = group_advantages(torch.full((3, 8), value))
        assert torch.equal(got, torch.zeros(3, 8))


@pytest.mark.parametrize("group_advantages", GROUP_ADVANTAGES)
def test_dr_grpo_advantages_keep_only_mean_baseline(group_advantages):
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    got = group_advantages(r, scale_std=False)
    torch.testing.assert_close(got, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def reference_clip_loss(logp, logp_old, adv, eps):
    """Scalar loop over tokens: -min(r A, clip(r) A) and whether the clipped branch is strictly the one taken."""
    loss, clipped = np.zeros_like(logp), np.zeros_like(logp, dtype=bool)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            r = math.exp(logp[i, t] - logp_old[i, t])
            a = adv[i]
            surr1, surr2 = r * a, min(max(r, 1 - eps), 1 + eps) * a
            loss[i, t] = -min(surr1, surr2)
            clipped[i, t] = surr2 < surr1
    return loss, clipped


@pytest.mark.parametrize("clipped_surrogate", CLIPPED_SURROGATE)
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # near on-policy, moderate and extreme ratios
def test_clipped_surrogate_matches_reference(scale, clipped_surrogate):
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 5
    logp = logp_old + torch.randn(4, 6, generator=g, dtype=torch.float64) * scale
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0], dtype=torch.float64)
    loss, ratio, clipped = clipped_surrogate(logp, logp_old, adv, 0.2)
    ref_loss, ref_clipped = reference_clip_loss(logp.numpy(), logp_old.numpy(), adv.numpy(), 0.2)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-12, atol=1e-12)
    assert np.array_equal(clipped.numpy(), ref_clipped)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(ratio, torch.exp(logp - logp_old))


@pytest.mark.parametrize("clipped_surrogate", CLIPPED_SURROGATE)
def test_ratio_one_gives_minus_advantage_and_no_clipping(clipped_surrogate):
    logp = torch.randn(3, 5)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, ratio, clipped = clipped_surrogate(logp, logp.clone(), adv, 0.2)
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert not clipped.any()
    torch.testing.assert_close(loss, -adv[:, None].expand(3, 5))


@pytest.mark.parametrize("clipped_surrogate", CLIPPED_SURROGATE)
def test_extreme_ratios_are_clipped_on_the_right_side(clipped_surrogate):
    logp_old = torch.zeros(2, 1)
    logp = torch.tensor([[20.0], [-20.0]])  # r = e^20 and e^-20
    # positive advantage, huge ratio: clipped at 1 + eps, no gradient
    loss, _, clipped = clipped_surrogate(logp[:1].requires_grad_(), logp_old[:1], torch.tensor([1.0]), 0.2)
    assert clipped.all() and loss.item() == pytest.approx(-1.2)
    # negative advantage, tiny ratio: clipped at 1 - eps
    loss, _, clipped = clipped_surrogate(logp[1:], logp_old[1:], torch.tensor([-1.0]), 0.2)
    assert clipped.all() and loss.item() == pytest.approx(0.8)
    # negative advantage, huge ratio: NOT clipped (PPO keeps the pessimistic unclipped branch)
    loss, _, clipped = clipped_surrogate(logp[:1], logp_old[:1], torch.tensor([-1.0]), 0.2)
    assert not clipped.any() and loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("clipped_surrogate", CLIPPED_SURROGATE)
def test_clipped_tokens_get_no_gradient(clipped_surrogate):
    logp = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss, _, clipped = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([1.0]), 0.2)
    loss.sum().backward()
    assert clipped.tolist() == [[True, False]]
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-1.0)


@pytest.mark.parametrize("k3_kl", K3_KL)
def test_k3_matches_formula_and_is_nonnegative(k3_kl):
    logp = torch.tensor([-1.0, -2.0, -0.1, -30.0])
    ref = torch.tensor([-1.0, -1.0, -3.0, -0.5])
    d = np.clip(logp.numpy() - ref.numpy(), -10, 10)
    np.testing.assert_allclose(k3_kl(logp, ref).numpy(), np.exp(-d) + d - 1, rtol=1e-6)
    assert (k3_kl(logp, ref) >= 0).all() and k3_kl(logp, logp).abs().max() == 0


@pytest.mark.parametrize("aggregate", AGGREGATE)
def test_aggregation_modes_with_padding(aggregate):
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(((1 + 2 + 3) / 3 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(10 / (2 * 8))
    with pytest.raises(ValueError):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate(loss, mask, "nope")
    assert aggregate(loss, torch.zeros_like(mask), "token-mean").item() == 0.0  # empty batch: no NaN


@pytest.mark.parametrize("aggregate", AGGREGATE)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_aggregates_sum_to_the_minibatch_value(mode, aggregate):
    """Gradient accumulation: each micro-batch normalised by the minibatch's counts (num_seqs, num_tokens) sums to the
    whole value (token-mean: DAPO eq. 10; seq-mean-token-mean: GRPO eq. 3; seq-mean-token-sum-norm: Dr. GRPO)."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 5, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 1])
    mask = torch.arange(5)[None] < lengths[:, None]
    whole = aggregate(loss, mask, mode, max_len=6)
    parts = sum(
        aggregate(loss[i : i + 3], mask[i : i + 3], mode, 6, num_seqs=7, num_tokens=int(mask.sum()))
        for i in range(0, 7, 3)
    )
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_batch_version_exact_lag():
    assert [batch_version(k, 1, 0) for k in range(4)] == [0, 1, 2, 3]
    assert [batch_version(k, 1, 3) for k in range(6)] == [0, 0, 0, 0, 1, 2]
    # s not a multiple of U: the first minibatch update of batch k still sees lag exactly s after warm-up
    assert [batch_version(k, 4, 6) for k in range(5)] == [0, 0, 2, 6, 10]
    assert all(k * 4 - batch_version(k, 4, 6) == 6 for k in range(2, 10))


def test_run_plan_and_the_default_length_reach_the_lag():
    """The default run at lag s: the FIFO warm-up (every batch generated by version 0), then 40 updates whose first
    minibatch is exactly s updates old; the plan names both phases and the batches (checked against batch_version)."""
    for s, U in [(256, 4), (256, 1), (3, 4), (6, 4), (1, 1), (5, 2)]:
        T = default_updates(s, U, 40)
        lags = [(k * U + j) - batch_version(k, U, s) for k in range(-(-T // U)) for j in range(U)][:T]  # update v-1
        initial = [k * U + j + 1 for k in range(-(-T // U)) for j in range(U) if batch_version(k, U, s) == 0][:T]
        assert sum(1 for v, lag in enumerate(lags) if v + 1 > len(initial)) >= 40
        assert all(lag in range(s, s + U) for lag in lags[len(initial) :])
        warm = len([v for v in initial if v <= T])
        assert run_plan(T, U, s) == (
            f"plan: updates 1-{warm} train on the initial policy's rollouts (FIFO warm-up); "
            f"updates {warm + 1}-{T} on rollouts {s if U == 1 else f'{s}-{s + U - 1}'} "
            f"updates old; {-(-T // U)} rollout batches, {U} update(s) each"
        )
    assert default_updates(256, 4, 40) == 300 and default_updates(0, 4, 40) == 40
    assert run_plan(40, 1, 0) == "plan: updates 1-40 on rollouts 0 updates old; 40 rollout batches, 1 update(s) each"
    assert run_plan(6, 2, 8) == (
        "plan: updates 1-6 train on the initial policy's rollouts (FIFO warm-up); 3 rollout batches, 2 update(s) each"
    )  # too short to reach the lag
    assert [default_eval_every(t) for t in (40, 80, 81, 300, 800)] == [10, 10, 20, 40, 100]


@pytest.mark.parametrize("script", ["dapo", "m2po", "dppo", "ppo_stale", "vineppo"])
def test_every_exact_lag_script_plans_as_grpo_does(script):
    import importlib
    import inspect

    import grpo

    module = importlib.import_module(script)
    for name in ("batch_version", "run_plan", "default_updates", "default_eval_every"):
        assert inspect.getsource(getattr(module, name)) == inspect.getsource(getattr(grpo, name)), name
