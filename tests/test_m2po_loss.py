"""M2PO's trust region against independent re-computations of the paper's / official code's rule (arXiv 2510.01161)."""

import math

import numpy as np
import pytest
import torch

from m2po import active_tokens, importance_weighted_pg, m2_cutoff, m2po_official, m2po_paper_mask, second_moment


def reference_cutoff(v, tau):
    """Brute force: try every data value as the cutoff, keep the largest whose capped mean is below tau."""
    v = [float(x) for x in v]
    if not v or sum(v) / len(v) <= tau:
        return math.inf
    ok = [c for c in v if sum(min(x, c) for x in v) / len(v) < tau]
    return max(ok) if ok else tau


def reference_paper_keep(v, tau):
    """Mask the largest values one at a time until the mean of the rest is below tau."""
    keep = [True] * len(v)
    if not v or np.mean(v) < tau:
        return keep
    for i in sorted(range(len(v)), key=lambda i: -v[i]):
        keep[i] = False
        rest = [x for x, k in zip(v, keep) if k]
        if rest and np.mean(rest) < tau:
            break
    return keep


def test_second_moment_matches_numpy_and_ignores_padding():
    lr = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert second_moment(lr, mask).item() == pytest.approx(np.mean([0.01, 0.09, 0.04]))


def test_active_quadrants():
    lr = torch.tensor([[0.1, -0.1, 0.1, -0.1, 0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 1.0]])
    mask = torch.ones_like(lr, dtype=torch.bool)
    assert active_tokens(lr, adv, mask).tolist() == [[True, False, False, True, False, False]]
    assert not active_tokens(lr, adv, torch.zeros_like(mask)).any()


@pytest.mark.parametrize("seed", range(6))
def test_cutoff_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(50, generator=g) * 0.3).pow(2)
    v[:3] *= 40  # a few outliers so the constraint binds
    assert m2_cutoff(v, 0.04) == pytest.approx(reference_cutoff(v.tolist(), 0.04))


def test_cutoff_edge_cases():
    assert m2_cutoff(torch.tensor([]), 0.04) == math.inf  # no active tokens
    assert m2_cutoff(torch.tensor([0.01, 0.03, 0.05]), 0.04) == math.inf  # mean 0.03 <= tau: no constraint
    # mean exactly tau: no constraint (the official rule: none while mean(v) <= tau). Binary fractions, so that the
    # float32 mean is tau exactly (0.02 and 0.06 average to 0.0399999991 in float32, below tau)
    exact = torch.tensor([0.03125, 0.09375])
    assert exact.mean().item() == 0.0625 and m2_cutoff(exact, 0.0625) == math.inf
    # a single huge outlier: the cutoff sits at the bulk's value, only the outlier is held back
    assert m2_cutoff(torch.tensor([0.001] * 99 + [10.0]), 0.04) == pytest.approx(0.001)
    # capped mean exactly tau at a data value (0.5: (0 + 3 * 0.5) / 4 = 0.375): strictly below is required
    assert m2_cutoff(torch.tensor([0.0, 0.5, 0.5, 4.0]), 0.375) == 0.0
    # every value >= tau: no data value qualifies, the cutoff is tau itself
    assert m2_cutoff(torch.tensor([0.25, 0.25, 0.25, 4.0]), 0.25) == 0.25


def reference_official_loss(logp, behav, adv, mask, tau):
    """Token by token: find the active set and cutoff, then -A * ratio with the clip bounds applied."""
    B, T = logp.shape
    lr = (logp - behav).tolist()
    active = [
        (b, t)
        for b in range(B)
        for t in range(T)
        if mask[b, t] and ((adv[b] > 0 and lr[b][t] > 0) or (adv[b] < 0 and lr[b][t] < 0))
    ]
    c = reference_cutoff([lr[b][t] ** 2 for b, t in active], tau)
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            r = math.exp(lr[b][t])
            if not math.isinf(c):
                r_c = min(max(r, math.exp(-math.sqrt(c))), math.exp(math.sqrt(c)))
                out[b, t] = max(-adv[b].item() * r, -adv[b].item() * r_c)
            else:
                out[b, t] = -adv[b].item() * r
    return out, c


@pytest.mark.parametrize("seed,scale", [(0, 0.05), (1, 0.5), (2, 1.5), (3, 0.3)])
def test_official_loss_matches_reference_and_clips_only_active_outliers(seed, scale):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(6, 5, generator=g) * 3
    logp = (behav + torch.randn(6, 5, generator=g) * scale).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 0.0, 1.5])
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3:] = False
    loss, ratio, clipped, info = m2po_official(logp, behav, adv, mask, 0.04)
    ref, c = reference_official_loss(logp.detach(), behav, adv, mask, 0.04)
    assert info["c"] == pytest.approx(c)
    torch.testing.assert_close(loss.detach().double(), ref, atol=1e-6, rtol=1e-6)
    if not math.isinf(c):
        assert info["eps_low"] == pytest.approx(1 - math.exp(-math.sqrt(c)))
        assert info["eps_high"] == pytest.approx(math.exp(math.sqrt(c)) - 1)
    lr = (logp - behav).detach()
    expected_clipped = info["active"] & (lr.pow(2) > c)
    assert torch.equal(clipped, expected_clipped)
    (loss * mask).sum().backward()
    grad_zero = logp.grad == 0
    assert torch.equal(grad_zero & mask & (adv[:, None] != 0), expected_clipped & (adv[:, None] != 0))
    # the constrained quantity is below tau afterwards
    if not math.isinf(c):
        assert info["v_after"][info["active"]].mean().item() < 0.04


def test_official_no_constraint_when_m2_below_tau_or_all_inactive():
    behav = torch.full((2, 3), -1.0)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    small = behav + torch.tensor([[0.01, 0.02, -0.05], [0.03, -0.01, 0.0]])
    loss, ratio, clipped, info = m2po_official(small, behav, adv, mask, 0.04)
    assert math.isinf(info["c"]) and not clipped.any()
    torch.testing.assert_close(loss, -adv[:, None] * ratio)
    # huge ratios but every token in the quadrant no PPO clip acts on (A > 0, r < 1; A < 0, r > 1)
    inactive = behav + torch.tensor([[-3.0, -2.0, -4.0], [3.0, 2.5, 5.0]])
    loss, ratio, clipped, info = m2po_official(inactive, behav, adv, mask, 0.04)
    assert math.isinf(info["c"]) and not clipped.any() and not info["active"].any()
    torch.testing.assert_close(loss, -adv[:, None] * ratio)


def test_official_ratio_one_is_the_plain_policy_gradient():
    behav = torch.full((3, 4), -2.0)
    adv = torch.tensor([1.0, 0.0, -1.0])
    loss, ratio, clipped, info = m2po_official(behav.clone(), behav, adv, torch.ones(3, 4, dtype=torch.bool), 0.04)
    assert torch.all(ratio == 1) and not clipped.any()
    torch.testing.assert_close(loss, -adv[:, None].expand(3, 4))


@pytest.mark.parametrize("seed", range(4))
def test_paper_mask_matches_one_at_a_time_reference(seed):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(5, 6, generator=g) * 0.3
    lr[0, 0] = 3.0  # an outlier
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[4, 2:] = False
    keep = m2po_paper_mask(lr, mask, 0.04)
    ref = reference_paper_keep(lr[mask].pow(2).tolist(), 0.04)
    assert keep[mask].tolist() == ref
    assert not keep[~mask].any()
    assert not keep[0, 0]  # the outlier goes first
    assert lr[keep].pow(2).mean() < 0.04


def test_paper_mask_edge_cases():
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert m2po_paper_mask(torch.tensor([[0.1, -0.1, 0.05, 0.0]]), mask, 0.04).all()  # M2 < tau: keep all
    assert not m2po_paper_mask(torch.full((1, 4), 1.0), mask, 0.04).any()  # all equal and large: all masked
    assert m2po_paper_mask(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bool), 0.04).sum() == 0


def test_importance_weighted_pg_gradient():
    behav = torch.tensor([[-1.0, -2.0]])
    logp = torch.tensor([[-0.5, -2.5]], requires_grad=True)
    adv = torch.tensor([2.0])
    loss, ratio = importance_weighted_pg(logp, behav, adv)
    torch.testing.assert_close(loss.detach(), -2.0 * torch.exp(logp.detach() - behav))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -2.0 * ratio.detach())  # d(-A r)/d logp = -A r: no clip anywhere


def test_paper_mask_mean_exactly_at_tau_is_masked():
    # M2 = (0.25^2 + 0.5^2) / 2 = 0.15625 = tau exactly (every value exact in binary): "below tau" is strict, so
    # the largest token goes and the rest (0.0625) is below tau. A `<=` in the first check would keep both.
    lr = torch.tensor([[0.25, 0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert m2po_paper_mask(lr, mask, 0.15625).tolist() == [[True, False]]
    assert reference_paper_keep([0.0625, 0.25], 0.15625) == [True, False]
    # after masking the largest, the rest's mean (0.0625) equals tau: not below it, so masking goes on (to all)
    lr = torch.tensor([[0.25, 0.25, 1.0]])
    assert m2po_paper_mask(lr, torch.ones(1, 3, dtype=torch.bool), 0.0625).tolist() == [[False, False, False]]
