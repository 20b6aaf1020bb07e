"""dapo.py's pure functions against independent computations of the paper's formulas (arXiv 2503.14476)."""

import math

import pytest
import torch

from dapo import aggregate, clipped_surrogate, dapo_reward, group_advantages, groups_with_spread, overlong_penalty


def reference_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13, written out case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max,l_cache", [(16, 4), (20480, 4096), (10, 1)])
def test_overlong_penalty_in_the_three_length_regimes(l_max, l_cache):
    lengths = sorted(
        {0, 1, l_max - l_cache - 1, l_max - l_cache, l_max - l_cache + 1, l_max - 1, l_max, l_max + 1, 2 * l_max} - {-1}
    )
    got = overlong_penalty(torch.tensor(lengths), l_max, l_cache)
    want = torch.tensor([reference_overlong(n, l_max, l_cache) for n in lengths])
    assert torch.allclose(got, want, atol=1e-6)
    assert got[lengths.index(l_max - l_cache)] == 0  # the last free length
    assert got[lengths.index(l_max)] == pytest.approx(-1.0)  # a response that used the whole budget
    assert got[lengths.index(l_max + 1)] == -1.0


def test_overlong_penalty_is_linear_inside_the_buffer():
    got = overlong_penalty(torch.arange(13, 17), 16, 4)
    assert torch.allclose(got, torch.tensor([-0.25, -0.5, -0.75, -1.0]))


def test_reward_is_plus_minus_one_plus_the_length_penalty():
    correct = torch.tensor([1, 0, 1, 0])
    lengths = torch.tensor([3, 3, 14, 16])
    assert dapo_reward(correct, lengths, 16, 4, shaping=False).tolist() == [1.0, -1.0, 1.0, -1.0]
    assert dapo_reward(correct, lengths, 16, 4, shaping=True).tolist() == [1.0, -1.0, 0.5, -2.0]


def test_groups_with_spread_drops_all_right_and_all_wrong_groups():
    correct = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1]])
    assert groups_with_spread(correct).tolist() == [False, False, True, True]


def test_a_batch_where_every_group_has_zero_spread_keeps_nothing():
    correct = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 1]])
    assert not groups_with_spread(correct).any()
    # ... and those groups would carry no signal anyway: zero advantage for every sample
    rewards = dapo_reward(correct.view(-1), torch.full((9,), 3), 16, 4, shaping=False).view(3, 3)
    assert torch.equal(group_advantages(rewards), torch.zeros(3, 3))


def test_spread_ignores_the_length_penalty():
    """All wrong with different lengths: shaped rewards differ, but the paper's filter is on correctness."""
    correct = torch.tensor([[0, 0, 0, 0]])
    rewards = dapo_reward(correct.view(-1), torch.tensor([3, 14, 15, 16]), 16, 4, shaping=True)
    assert len(set(rewards.tolist())) > 1
    assert not groups_with_spread(correct).any()


def reference_clip(logp, logp_behav, adv, eps_low, eps_high):
    """Per-token max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with python floats (DAPO eq. 8)."""
    loss, clipped = [], []
    for i in range(len(logp)):
        row_l, row_c = [], []
        for t in range(len(logp[i])):
            r = math.exp(logp[i][t] - logp_behav[i][t])
            a = adv[i]
            u, c = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
            row_l.append(max(u, c))
            row_c.append(c > u)
        loss.append(row_l)
        clipped.append(row_c)
    return loss, clipped


def test_clip_higher_is_asymmetric():
    # ratios 1.25 (inside the higher bound 1.28, outside the symmetric 1.2), 1.3 (outside both), 0.75 (below 0.8)
    ratios = torch.tensor([[1.25, 1.3, 0.75, 1.0]])
    logp_behav = torch.zeros_like(ratios)
    logp = ratios.log()
    for adv, eps_high, expected in [
        (1.0, 0.28, [False, True, False, False]),
        (1.0, 0.2, [True, True, False, False]),
        (-1.0, 0.28, [False, False, True, False]),
    ]:
        loss, ratio, clipped = clipped_surrogate(logp, logp_behav, torch.tensor([adv]), 0.2, eps_high)
        assert clipped[0].tolist() == expected
        ref_loss, ref_clipped = reference_clip(logp.tolist(), logp_behav.tolist(), [adv], 0.2, eps_high)
        assert torch.allclose(loss, torch.tensor(ref_loss), atol=1e-6)
        assert clipped.tolist() == ref_clipped
        assert torch.allclose(ratio, ratios, atol=1e-6)


def test_clipped_surrogate_matches_the_formula_on_random_and_extreme_ratios():
    g = torch.Generator().manual_seed(0)
    logp_behav = torch.randn(5, 7, generator=g) - 2
    logp = logp_behav + torch.randn(5, 7, generator=g) * torch.tensor([0.0, 0.01, 0.3, 3.0, 20.0])[:, None]
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0, -3.0])
    loss, _, clipped = clipped_surrogate(logp, logp_behav, adv, 0.2, 0.28)
    ref_loss, ref_clipped = reference_clip(logp.tolist(), logp_behav.tolist(), adv.tolist(), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor(ref_loss), rtol=1e-5)
    assert clipped.tolist() == ref_clipped
    assert not clipped[0].any() and not clipped[2].any()  # ratio 1 and zero advantage never clip


def test_token_level_loss_weights_long_sequences_more_than_the_sequence_mean():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]).bool()
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(8.0 / 5.0)  # DAPO eq. 10
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.0 + 4.0) / 2)  # GRPO eq. 3


def test_filtered_samples_leave_numerator_and_denominator():
    """Overlong filtering: a masked-out sample changes neither the token sum nor the token count."""
    loss = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    keep = torch.tensor([[1, 1], [0, 0]]).bool()
    assert aggregate(loss, keep, "token-mean", num_tokens=2).item() == pytest.approx(1.5)
    assert aggregate(loss, keep, "seq-mean-token-mean", num_seqs=1).item() == pytest.approx(1.5)
