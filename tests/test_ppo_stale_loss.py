"""ppo_stale.py's pure functions against independent re-computations: AReaL's decoupled PPO loss (arXiv 2505.24298),
batch-whitened advantages and the admission control of the bounded-staleness mode."""

import math
import random

import numpy as np
import pytest
import torch

from ppo_stale import admits, aggregate, batch_advantages, clipped_surrogate, decoupled_ppo_loss


def reference_loss(logp, prox, behav, adv, mask, eps, cap):
    """Token by token: w = pi_prox / pi_behav (0 above the cap), u = pi_theta / pi_prox, L = w * max(-A u, -A clip(u));
    then sum over the mask divided by the number of response tokens (capped ones included)."""
    B, T = logp.shape
    total, n, per_tok = 0.0, 0, torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            n += 1
            w = math.exp(float(prox[b, t] - behav[b, t]))
            u = math.exp(float(logp[b, t] - prox[b, t]))
            a = float(adv[b])
            loss = 0.0 if w > cap else w * max(-a * u, -a * min(max(u, 1 - eps), 1 + eps))
            per_tok[b, t] = loss
            total += loss
    return per_tok, total / max(n, 1)


def random_case(seed, B=5, T=6, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + torch.randn(B, T, generator=g) * scale * 3  # stale data: some w far above the cap of 5
    logp = prox + torch.randn(B, T, generator=g) * scale
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # padding
    mask[3, 2:] = False
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("seed", range(5))
def test_loss_matches_per_token_reference_and_keeps_capped_tokens_in_the_denominator(seed):
    logp, prox, behav, adv, mask = random_case(seed)
    loss, info = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    ref_tok, ref_mean = reference_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    torch.testing.assert_close((loss * mask).double(), ref_tok, atol=1e-6, rtol=1e-5)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(ref_mean, rel=1e-5, abs=1e-7)
    w = torch.exp(prox - behav)
    assert torch.equal(info["capped"], mask & (w > 5.0))
    assert not info["capped"][~mask].any()
    if seed == 0:
        assert info["capped"].any() and (~info["capped"] & mask).any()  # the case exercises both kinds of token
    # the denominator is the number of response tokens, not of the tokens the cap kept
    kept = mask & ~info["capped"]
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx((loss * kept).sum().item() / mask.sum().item())


def test_prox_equal_to_behaviour_is_plain_ppo():
    logp, _, behav, adv, mask = random_case(7)
    loss, info = decoupled_ppo_loss(logp, behav, behav, adv, mask, 0.2, 5.0)
    ppo, ratio, clipped = clipped_surrogate(logp, behav, adv, 0.2)
    torch.testing.assert_close(loss, ppo)
    assert torch.all(info["w"] == 1) and not info["capped"].any()
    assert torch.equal(info["clipped"], clipped & mask)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(aggregate(ppo, mask, "token-mean").item())


def test_on_policy_u_is_one_and_nothing_is_clipped():
    _, prox, behav, adv, mask = random_case(3)
    loss, info = decoupled_ppo_loss(prox.clone(), prox, behav, adv, mask, 0.2, 5.0)
    assert torch.all(info["u"] == 1) and not info["clipped"].any()
    w = torch.exp(prox - behav)
    expected = torch.where(mask & (w > 5.0), torch.zeros_like(w), -adv[:, None] * w)
    torch.testing.assert_close(loss, expected)


def test_extreme_ratios():
    behav = torch.full((4, 3), -2.0)
    # w: e^-6 (tiny, kept), 1, e^6 (far above the cap, masked); u: e^5 and e^-5 (clipped where the clip binds)
    prox = behav + torch.tensor([[-6.0, 0.0, 6.0]]).expand(4, 3)
    logp = prox + torch.tensor([[5.0], [-5.0], [5.0], [-5.0]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    loss, info = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    ref, _ = reference_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-5)
    assert info["capped"][:, 2].all() and not info["capped"][:, :2].any()
    assert torch.all(loss[:, 2] == 0)
    # A > 0 with u = e^5 and A < 0 with u = e^-5: the clip binds; the other two rows take the unclipped branch
    assert info["clipped"][0, :2].all() and info["clipped"][3, :2].all()
    assert not info["clipped"][1].any() and not info["clipped"][2].any()
    assert torch.isfinite(loss).all()


def test_zero_advantage_and_padding_give_zero_loss_and_gradient():
    logp, prox, behav, _, mask = random_case(2)
    logp.requires_grad_(True)
    loss, info = decoupled_ppo_loss(logp, prox, behav, torch.zeros(5), mask, 0.2, 5.0)
    assert torch.all(loss == 0) and not info["clipped"].any()
    aggregate(loss, mask, "token-mean").backward()
    assert torch.all(logp.grad == 0)
    # padded positions never count, whatever their values
    logp2, prox2, behav2, adv, _ = random_case(2)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[:, :2] = True
    garbage = logp2.clone()
    garbage[:, 2:] = 50.0
    a, _ = decoupled_ppo_loss(logp2, prox2, behav2, adv, mask, 0.2, 5.0)
    b, _ = decoupled_ppo_loss(garbage, prox2, behav2, adv, mask, 0.2, 5.0)
    assert aggregate(a, mask, "token-mean").item() == aggregate(b, mask, "token-mean").item()


@pytest.mark.parametrize("seed", range(3))
def test_gradient_is_minus_a_w_u_where_unclipped(seed):
    logp, prox, behav, adv, mask = random_case(seed)
    logp.requires_grad_(True)
    loss, info = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    (loss * mask).sum().backward()
    u, w = torch.exp(logp.detach() - prox), torch.exp(prox - behav)
    live = mask & ~info["capped"] & ~info["clipped"]
    expected = torch.where(live, -adv[:, None] * w * u, torch.zeros_like(u))  # d(w * -A u)/d logp = -A w u
    torch.testing.assert_close(logp.grad, expected)
    assert (logp.grad[info["clipped"] | info["capped"]] == 0).all()
    assert live.any() and info["clipped"].any()


def test_batch_advantages_whiten_over_tokens():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    lengths = torch.tensor([3, 5, 2, 9, 1, 6])
    toks = np.repeat(rewards.numpy(), lengths.numpy()).astype(np.float64)  # every token carries its sample's reward
    # the correct samples are the longer ones: the token-weighted mean and std differ from the per-sample ones
    assert toks.mean() != pytest.approx(rewards.numpy().mean()) and toks.std() != pytest.approx(rewards.numpy().std())
    expected = (rewards.numpy() - toks.mean()) / (toks.std() + 1e-6)  # numpy std: biased, as AReaL's normalisation
    np.testing.assert_allclose(batch_advantages(rewards, lengths).numpy(), expected, rtol=1e-6)
    # the paper's +-5 rewards give the same advantages up to eps; equal rewards give zeros
    np.testing.assert_allclose(batch_advantages(10 * rewards - 5, lengths).numpy(), expected, rtol=1e-5)
    assert torch.all(batch_advantages(torch.ones(4), torch.tensor([1, 2, 3, 4])) == 0)
    # token-weighted whitening: mean 0 and std 1 over the tokens
    a = np.repeat(batch_advantages(rewards, lengths).numpy(), lengths.numpy())
    assert abs(a.mean()) < 1e-6 and a.std() == pytest.approx(1.0, rel=1e-5)


def test_admission_formula():
    B, G = 8, 4
    # eta = 0: the first batch may start at version 0, the second only once the trainer finished training step 1
    assert admits(0, 0, 0, B, G, 1) and admits(4, 0, 0, B, G, 1) and not admits(8, 0, 0, B, G, 1)
    assert admits(8, 1, 0, B, G, 1)
    # with U = 2 updates per batch, version 1 is mid-step: still training step 0
    assert not admits(8, 1, 0, B, G, 2) and admits(8, 2, 0, B, G, 2)
    # eta = 2: up to three batches ahead of version 0
    assert admits(20, 0, 2, B, G, 1) and not admits(24, 0, 2, B, G, 1)


@pytest.mark.parametrize("eta,U", [(0, 1), (0, 2), (1, 1), (1, 3), (3, 2)])
def test_admission_bounds_the_start_version_in_a_random_timeline(eta, U):
    """Simulate a producer that starts groups whenever ``admits`` lets it and a trainer that makes one update at a time,
    consuming batch k at update kU, randomly interleaved; every sample of batch k must have started at a version
    >= (k - eta) * U (in updates), and the producer must really run ahead when eta > 0."""
    rng = random.Random(eta * 10 + U)
    B, G, num_batches = 8, 4, 12
    started_at, version, lags = [], 0, []  # the start version of every started sample; version = updates so far
    while version < num_batches * U:
        if rng.random() < 0.5:
            if len(started_at) < num_batches * B and admits(len(started_at), version, eta, B, G, U):
                started_at += [version] * G
        elif version % U or len(started_at) >= (version // U + 1) * B:  # a new batch needs all its samples
            if version % U == 0:
                k = version // U
                lags += [k * U - v for v in started_at[k * B : (k + 1) * B]]
            version += 1
    assert max(lags) <= eta * U
    assert (max(lags) > 0) == (eta > 0)
