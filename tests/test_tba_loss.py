"""tba.py's pure functions against independent loop computations: the trajectory-balance loss with the VarGrad log Z,
the beta schedule, and the replay buffer (capacity, de-duplication, recency and reward-prioritised draws)."""

import math

import numpy as np
import pytest
import torch

from tba import beta_at, buffer_insert, default_updates, log_z, round_version, run_plan, sample_slots, tb_loss


def loop_tb(logp, logp_ref, rewards, slot, beta):
    """The formula written out with Python floats: log Z per slot, then the mean squared residual."""
    logz = {}
    for j in set(slot):
        members = [i for i in range(len(slot)) if slot[i] == j]
        logz[j] = sum(rewards[i] / beta - (logp[i] - logp_ref[i]) for i in members) / len(members)
    residuals = [logz[slot[i]] + logp[i] - logp_ref[i] - rewards[i] / beta for i in range(len(slot))]
    return sum(d * d for d in residuals) / len(slot), [logz[j] for j in slot], residuals


def seq_logp_from_tokens(tok_logp, mask):
    """Sequence log-probs as tba.py forms them: the sum of per-token log-probs over the real response tokens."""
    return (tok_logp * mask).sum(-1)


def test_tb_loss_and_log_z_match_the_formula():
    g = torch.Generator().manual_seed(0)
    logp = -5 * torch.rand(7, generator=g)
    logp_ref = -5 * torch.rand(7, generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0])
    slot = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    beta = 0.07
    loss, lz, delta = tb_loss(logp, logp_ref, rewards, slot, beta)
    ref_loss, ref_lz, ref_delta = loop_tb(logp.tolist(), logp_ref.tolist(), rewards.tolist(), slot.tolist(), beta)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert lz.tolist() == pytest.approx(ref_lz, rel=1e-5)
    assert delta.tolist() == pytest.approx(ref_delta, rel=1e-4, abs=1e-3)
    assert log_z(logp, logp_ref, rewards, slot, beta).tolist() == pytest.approx(ref_lz, rel=1e-5)
    # residuals of a slot sum to zero: log Z is their mean
    for j in range(3):
        assert delta[slot == j].sum().item() == pytest.approx(0.0, abs=1e-3)


def test_masked_padding_tokens_do_not_count():
    tok = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 0.0, 0.0], [-0.7, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    noisy = tok.masked_fill(~mask, -123.0)  # whatever sits under the padding must not matter
    seq = seq_logp_from_tokens(noisy, mask)
    assert seq.tolist() == pytest.approx([-3.5, -0.3, -0.8])
    ref = torch.tensor([-3.0, -1.0, -1.0])
    r, slot = torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long)
    loss, _, _ = tb_loss(seq, ref, r, slot, 0.5)
    assert loss.item() == pytest.approx(loop_tb([-3.5, -0.3, -0.8], ref.tolist(), r.tolist(), [0, 0, 0], 0.5)[0])


def test_equal_rewards_and_equal_drift_give_zero_loss_and_one_sample_slots_are_zero():
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    ref = logp - 0.3  # every sample drifted by the same amount
    loss, lz, _ = tb_loss(logp, ref, torch.ones(4), torch.zeros(4, dtype=torch.long), 0.1)
    assert loss.item() == pytest.approx(0.0, abs=1e-8) and lz.tolist() == pytest.approx([10 - 0.3] * 4)
    # K = 1: log Z equals the sample's own value, the residual is 0 whatever the reward
    loss, lz, delta = tb_loss(
        torch.tensor([-2.0, -5.0]), torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), 0.01
    )
    assert loss.item() == 0.0 and delta.abs().max().item() == 0.0
    assert lz.tolist() == pytest.approx([100 + 1.0, 0 + 4.0])


def test_log_z_is_detached_and_the_gradient_is_twice_the_residual():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.2, -1.5, -1.0])
    r, slot, beta = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), 0.2
    loss, lz, delta = tb_loss(logp, ref, r, slot, beta)
    assert not lz.requires_grad
    loss.backward()
    # with log Z a constant, d/dlogp_i of mean(delta^2) = 2 delta_i / N (not the centred VarGrad gradient)
    assert logp.grad.tolist() == pytest.approx((2 * delta / 3).tolist(), rel=1e-5)
    _, _, ref_delta = loop_tb(logp.tolist(), ref.tolist(), r.tolist(), slot.tolist(), beta)
    assert delta.tolist() == pytest.approx(ref_delta, rel=1e-5)


def test_micro_batch_losses_sum_to_the_batch_loss():
    g = torch.Generator().manual_seed(1)
    logp, ref = -3 * torch.rand(6, generator=g), -3 * torch.rand(6, generator=g)
    r, slot = torch.tensor([1.0, 0, 0, 1, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 1])
    whole, _, _ = tb_loss(logp, ref, r, slot, 0.3)
    parts = [
        tb_loss(logp[i : i + 3], ref[i : i + 3], r[i : i + 3], torch.zeros(3, dtype=torch.long), 0.3, 6)[0]
        for i in (0, 3)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_beta_schedule_endpoints():
    assert beta_at(0, 0.014, 0.004, 500) == pytest.approx(0.014)
    assert beta_at(250, 0.014, 0.004, 500) == pytest.approx(0.009)
    assert beta_at(500, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_at(900, 0.014, 0.004, 500) == pytest.approx(0.004)
    assert beta_at(3, 0.1, 0.05, 0) == pytest.approx(0.05)  # no annealing: the end value throughout


def item(resp, reward=0.0, version=0):
    return dict(response=list(resp), reward=reward, version=version)


def test_buffer_keeps_the_newest_up_to_capacity():
    buf = {}
    dups, evicted = buffer_insert(buf, (1,), [item([i], version=i) for i in range(150)], 100)
    assert (dups, evicted) == (0, 50) and len(buf[(1,)]) == 100
    assert [h["version"] for h in buf[(1,)]] == list(range(50, 150))
    assert buffer_insert(buf, (2,), [item([7])], 100) == (0, 0) and len(buf) == 2  # prompts are separate


def test_buffer_deduplicates_responses_per_prompt_keeping_the_newest_copy():
    buf = {}
    assert buffer_insert(buf, (1,), [item([5, 6], 1.0, 0), item([5, 7], 0.0, 0), item([5, 6], 1.0, 0)], 100) == (1, 0)
    assert [h["response"] for h in buf[(1,)]] == [[5, 7], [5, 6]]
    assert buffer_insert(buf, (1,), [item([5, 7], 0.0, 3)], 100) == (1, 0)  # a later round refreshes it
    assert [(h["response"], h["version"]) for h in buf[(1,)]] == [([5, 6], 0), ([5, 7], 3)]
    assert buffer_insert(buf, (2,), [item([5, 7], 0.0, 3)], 100) == (0, 0)  # the same text for another prompt is kept


def test_recency_probability_is_realised():
    rng = np.random.default_rng(0)
    buf = {(p,): [item([p, i], 0.0, 0) for i in range(4)] for p in range(10)}
    m, draws = 0.95, 4000
    rec = sum(sample_slots(buf, 1, 4, m, 1.0, rng)[0][2] for _ in range(draws))
    sd = math.sqrt(draws * m * (1 - m))
    assert abs(rec - draws * m) < 4 * sd
    assert all(sample_slots(buf, 3, 4, 1.0, 1.0, rng)[j][2] for j in range(3))
    assert not any(s[2] for s in sample_slots(buf, 3, 4, 0.0, 1.0, rng))


def test_recency_takes_the_newest_samples_of_prompts_refreshed_at_the_latest_sync():
    buf = {}
    buffer_insert(buf, (1,), [item([i], 0.0, 0) for i in range(5)], 100)
    buffer_insert(buf, (2,), [item([i], 0.0, 0) for i in range(5)], 100)
    buffer_insert(buf, (1,), [item([10 + i], 0.0, 2) for i in range(6)], 100)  # prompt 1 refreshed by version 2
    buffer_insert(buf, (3,), [item([20 + i], 0.0, 2) for i in range(2)], 100)
    rng = np.random.default_rng(0)
    for _ in range(50):
        slots = sample_slots(buf, 2, 4, 1.0, 1.0, rng)
        got = {p: [h["response"][0] for h in items] for p, items, rec in slots}
        assert set(got) == {(1,), (3,)}  # the two prompts with version-2 samples, each once
        assert got[(1,)] == [12, 13, 14, 15]  # the newest 4 of its version-2 samples, oldest first
        assert got[(3,)] == [20, 21]  # fewer than K held: all of them
    # a third recency slot finds no refreshed prompt left: it becomes a prioritised draw of the remaining prompt
    slots = sample_slots(buf, 3, 4, 1.0, 1.0, rng)
    assert [s[2] for s in slots] == [True, True, False] and slots[2][0] == (2,)


def test_prioritised_draws_follow_softmax_of_reward_times_inverse_temperature():
    rewards, inv_temp, draws = [0.0, 1.0, 0.5, 0.0], 2.0, 20000
    buf = {(1,): [item([i], r, 0) for i, r in enumerate(rewards)]}
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(draws):
        ((_, items, rec),) = sample_slots(buf, 1, 1, 0.0, inv_temp, rng)
        assert not rec
        counts[items[0]["response"][0]] += 1
    p = np.exp(np.array(rewards) * inv_temp)
    p /= p.sum()
    assert counts / draws == pytest.approx(p, abs=4 * math.sqrt(0.25 / draws))
    # k >= held: every sample once, no repeats, in buffer order
    ((_, items, _),) = sample_slots(buf, 1, 8, 0.0, inv_temp, rng)
    assert [h["response"][0] for h in items] == [0, 1, 2, 3]


def test_same_seed_same_draws():
    buf = {(p,): [item([p, i], float(i % 2), p % 3) for i in range(6)] for p in range(8)}
    a = sample_slots(buf, 4, 3, 0.5, 1.0, np.random.default_rng(5))
    b = sample_slots(buf, 4, 3, 0.5, 1.0, np.random.default_rng(5))
    assert [(p, [h["response"] for h in i], r) for p, i, r in a] == [
        (p, [h["response"] for h in i], r) for p, i, r in b
    ]


def test_tba_plan_and_default_length():
    assert default_updates(2, 20) == 20 and default_updates(0, 20) == 20 and default_updates(256, 20) == 296
    assert run_plan(296, 256) == (
        "plan: updates 1-256 train on the initial policy's samples; then the searcher gets "
        "the trainer's weights every 256 update(s) (recency draws at most 256 updates old) "
        "until update 296"
    )
    assert run_plan(20, 0) == "plan: 20 updates, synchronous: each round is generated by the trainer's current weights"
    assert run_plan(10, 16) == (
        "plan: all 10 updates train on the initial policy's samples (the first sync would be at update 16)"
    )


@pytest.mark.parametrize("k", [1, 2, 3, 16])
def test_round_version_is_the_newest_sync_before_the_update_that_draws_the_round(k):
    """Lockstep: round n is generated while update n - 1 trains, by the newest weights synced by then (a multiple of
    k, at most n - 1), and update n draws it: its recency draws are 1 to k updates old."""
    assert round_version(0, k) == 0
    for n in range(1, 60):
        v = round_version(n, k)
        assert v % k == 0 and v <= n - 1 < v + k  # the newest sync at or before update n - 1
        assert 1 <= n - v <= k
    assert [round_version(n, 2) for n in range(7)] == [0, 0, 0, 2, 2, 4, 4]
