"""DPPO's trust region against independent re-computations of the paper's formulas (arXiv 2602.04879, eqs. 11-14):
the binary TV and KL, the mask by direction and sign of the advantage, the loss, its gradient and its denominators."""

import math

import pytest
import torch

from dppo import aggregate, binary_kl, binary_tv, dppo_loss, dppo_mask


def ref_tv(mu: float, pi: float) -> float:
    """eq. 13"""
    return abs(mu - pi)


def ref_kl(mu: float, pi: float) -> float:
    """eq. 14: KL(mu || pi) of the Bernoulli pair (p(token), 1 - p(token))"""
    rest = 0.0 if mu == 1.0 else (1 - mu) * math.log((1 - mu) / (1 - pi))
    return mu * math.log(mu / pi) + rest


def ref_keep(mu: float, pi: float, a: float, div: float, delta: float) -> bool:
    """eq. 12, token by token: M = 0 iff (A > 0 and r > 1 and D > delta) or (A < 0 and r < 1 and D > delta)"""
    r = pi / mu
    return not ((a > 0 and r > 1 and div > delta) or (a < 0 and r < 1 and div > delta))


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


PAIRS = [(0.5, 0.652), (0.05, 0.18), (1e-4, 1e-2), (0.99, 0.8), (0.9, 0.5), (0.5, 0.9), (0.3, 0.1), (0.2, 0.2)]


def test_binary_divergences_match_the_formulas():
    mu, pi = logs(*(m for m, _ in PAIRS)), logs(*(p for _, p in PAIRS))
    for i, (m, p) in enumerate(PAIRS):
        assert binary_tv(mu, pi)[i].item() == pytest.approx(ref_tv(m, p), rel=1e-12, abs=1e-15)
        assert binary_kl(mu, pi)[i].item() == pytest.approx(ref_kl(m, p), rel=1e-6, abs=1e-12)
    assert binary_tv(mu, pi)[-1] == 0 and binary_kl(mu, pi)[-1] == pytest.approx(0.0, abs=1e-15)
    assert (binary_kl(mu, pi) >= -1e-15).all()


def test_binary_kl_is_kl_from_the_behaviour_policy_not_the_reverse():
    """KL(mu || pi) and KL(pi || mu) differ: the function takes mu first and weighs by mu, as eq. 14 and all three
    codebases do."""
    mu, pi = logs(0.3, 0.05), logs(0.1, 0.18)
    ours = binary_kl(mu, pi)
    assert ours[0].item() == pytest.approx(ref_kl(0.3, 0.1)) and ours[0].item() != pytest.approx(ref_kl(0.1, 0.3))
    assert ours[1].item() == pytest.approx(ref_kl(0.05, 0.18)) and ours[1].item() != pytest.approx(ref_kl(0.18, 0.05))


def test_binary_kl_stays_finite_where_a_probability_is_one():
    """log(1 - pi) at pi = 1: the eps of the authors' code keeps it finite; a confident token that stays confident
    has a tiny divergence."""
    kl = binary_kl(torch.tensor([0.0, math.log(1 - 1e-4), 0.0]), torch.tensor([math.log(1 - 1e-4), 0.0, 0.0]))
    assert torch.isfinite(kl).all() and (kl < 1e-2).all() and kl[2] == 0


def test_the_mask_by_direction_and_sign_of_the_advantage():
    """Every combination of A's sign and the direction pi moved, beyond delta and within it, against eq. 12."""
    cases = []  # (mu, pi, A)
    for mu, pi in [(0.5, 0.9), (0.9, 0.5), (0.5, 0.55), (0.55, 0.5)]:  # up / down beyond 0.15, up / down within
        for a in (1.0, -1.0, 0.0):
            cases.append((mu, pi, a))
    mu, pi = logs(*(c[0] for c in cases)), logs(*(c[1] for c in cases))
    adv = torch.tensor([c[2] for c in cases], dtype=torch.float64)[None]
    mask = torch.ones(1, len(cases), dtype=torch.bool)
    for name, div_fn, ref_div, delta in [("tv", binary_tv, ref_tv, 0.15), ("kl", binary_kl, ref_kl, 0.05)]:
        div = div_fn(mu, pi)[None]
        keep = dppo_mask(div, (pi - mu)[None], adv, mask, delta)[0].tolist()
        expected = [ref_keep(m, p, a, ref_div(m, p), delta) for m, p, a in cases]
        assert keep == expected, name
        # the four dropped cases: A > 0 pushed up beyond delta, A < 0 pushed down beyond delta
        assert [c for c, k in zip(cases, keep) if not k] == [(0.5, 0.9, 1.0), (0.9, 0.5, -1.0)], name


def test_a_token_exactly_at_delta_is_kept_and_padding_never_is():
    div = torch.tensor([[0.25, 0.25 + 1e-9, 0.25, 0.9]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.1, 0.1, -0.1, 0.1]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert dppo_mask(div, log_ratio, adv, mask, 0.25).tolist() == [[True, False, True, False]]
    # the same through the divergence: |0.75 - 0.5| = 0.25 exactly in floating point
    assert binary_tv(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.75)])).item() == pytest.approx(0.25)
    assert dppo_mask(torch.tensor([[0.25]]), torch.tensor([[0.4]]), torch.tensor([1.0]), mask[:, :1], 0.25).all()


def test_tv_and_kl_drop_different_tokens():
    """mu 0.5 -> pi 0.652: TV 0.152 > 0.15 but KL 0.048 < 0.05; mu 0.05 -> 0.18: TV 0.13 < 0.15 but KL 0.076 > 0.05
    (A > 0, both pushed up); a rare token raised 100x (mu 1e-4 -> 1e-2, where a PPO clip would act) is kept by both."""
    logp_behav, logp = logs(0.5, 0.05, 1e-4)[None], logs(0.652, 0.18, 1e-2)[None]
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool)
    _, ratio, masked_tv, _ = dppo_loss(logp, logp_behav, adv, mask, "tv", 0.15)
    _, _, masked_kl, _ = dppo_loss(logp, logp_behav, adv, mask, "kl", 0.05)
    assert masked_tv.tolist() == [[True, False, False]] and masked_kl.tolist() == [[False, True, False]]
    assert ratio[0, 2].item() == pytest.approx(100.0)


@pytest.mark.parametrize("divergence,delta", [("tv", 0.15), ("kl", 0.05)])
def test_loss_and_gradient_against_a_token_by_token_computation(divergence, delta):
    """Random log-probs and advantages: the loss is -M A r (no clip), a dropped token's gradient is exactly 0 and a
    kept one's is -A r with respect to its log-prob, i.e. -A r grad(log pi) for the parameters."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 7
    logp_behav = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    # pi <= 0.999: there the eps of binary_kl's second term moves it by < 1e-5 (eq. 14 itself has none)
    logp = (logp_behav + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6).clamp(max=math.log(0.999))
    logp.requires_grad_(True)
    adv = torch.tensor([1.5, -0.5, 0.0, -2.0], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3, 5:] = False
    loss, ratio, masked, div = dppo_loss(logp, logp_behav, adv, mask, divergence, delta)
    (loss * mask).sum().backward()
    ref_div = ref_tv if divergence == "tv" else ref_kl
    n_dropped = 0
    for b in range(B):
        for t in range(T):
            mu, pi, a = math.exp(logp_behav[b, t].item()), math.exp(logp[b, t].item()), adv[b].item()
            r = pi / mu
            if not mask[b, t]:
                assert not masked[b, t] and logp.grad[b, t] == 0
                continue
            assert div[b, t].item() == pytest.approx(ref_div(mu, pi), rel=1e-6, abs=1e-5)
            keep = ref_keep(mu, pi, a, ref_div(mu, pi), delta)
            n_dropped += not keep
            assert masked[b, t].item() == (not keep)
            assert ratio[b, t].item() == pytest.approx(r, rel=1e-9)
            assert loss[b, t].item() == pytest.approx(-a * r if keep else 0.0, rel=1e-9, abs=1e-12)
            if keep:
                assert logp.grad[b, t].item() == pytest.approx(-a * r, rel=1e-9, abs=1e-12)
            else:
                assert logp.grad[b, t].item() == 0.0  # exactly: the mask takes no gradient
    assert n_dropped > 0 and not masked[2].any()  # some tokens dropped; A = 0 never is


def test_zero_advantage_tokens_are_never_masked_and_carry_nothing():
    logp = torch.tensor([[math.log(0.9), math.log(0.1)]], requires_grad=True)
    logp_behav = torch.tensor([[math.log(0.1), math.log(0.9)]])
    loss, _, masked, _ = dppo_loss(
        logp, logp_behav, torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), "tv", 0.15
    )
    loss.sum().backward()
    assert not masked.any() and (loss == 0).all() and (logp.grad == 0).all()


def test_on_policy_nothing_is_masked_and_the_loss_is_minus_a():
    logp = torch.log(torch.tensor([[0.3, 0.99, 1e-5], [0.5, 0.5, 0.5]]))
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    for divergence in ("tv", "kl"):
        loss, ratio, masked, div = dppo_loss(logp, logp.clone(), adv, mask, divergence, 1e-9)
        assert not masked.any() and (ratio == 1).all() and (div.abs() < 1e-12).all()
        assert torch.equal(loss, -adv[:, None].expand(2, 3))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_masked_tokens_stay_in_the_denominator(mode):
    """As in the authors' code, verl and TRL, the mask zeroes a token's loss but keeps the token in the aggregation's
    denominator (all response tokens, or B x max_len)."""
    logp_behav = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.55, 0.5], [0.1, 0.45, 0.5]]))  # token (0, 0) and (1, 0) beyond 0.15
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[True, True, True], [True, True, False]])
    loss, ratio, masked, _ = dppo_loss(logp, logp_behav, adv, mask, "tv", 0.15)
    assert masked.tolist() == [[True, False, False], [True, False, False]]
    per_tok = {(0, 1): -1.0 * 1.1, (0, 2): -1.0, (1, 1): 1.0 * 0.9}  # the kept tokens' -A r
    if mode == "token-mean":
        expected = sum(per_tok.values()) / 5  # 5 response tokens, 2 of them masked
    elif mode == "seq-mean-token-mean":
        expected = ((per_tok[0, 1] + per_tok[0, 2]) / 3 + per_tok[1, 1] / 2) / 2
    else:
        expected = sum(per_tok.values()) / (2 * 4)  # max_len 4
    assert aggregate(loss, mask, mode, max_len=4).item() == pytest.approx(expected, rel=1e-6)


def test_ratio_cap_truncates_the_weight_and_its_gradient():
    """--ratio-cap C (truncated importance sampling, as TRL's clip_ratio_c): a kept token with r > C has loss -A C
    and gradient -A C with respect to its log-prob; r <= C is unchanged; the returned ratio stays uncapped."""
    logp_behav = torch.log(torch.tensor([[1e-4, 0.5]], dtype=torch.float64))
    logp = torch.log(torch.tensor([[1e-2, 0.55]], dtype=torch.float64)).requires_grad_(True)
    adv, mask = torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, ratio, masked, _ = dppo_loss(logp, logp_behav, adv, mask, "tv", 0.15, ratio_cap=20.0)
    loss.sum().backward()
    assert not masked.any() and ratio[0, 0].item() == pytest.approx(100.0)
    assert loss[0].tolist() == pytest.approx([-2.0 * 20.0, -2.0 * 1.1])
    assert logp.grad[0].tolist() == pytest.approx([-2.0 * 20.0, -2.0 * 1.1])
    logp.grad = None
    uncapped, *_ = dppo_loss(logp, logp_behav, adv, mask, "tv", 0.15)
    uncapped.sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 * 100.0)  # no cap: the rare token's full weight
