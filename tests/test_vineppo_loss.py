"""vineppo.py's pure functions against hand-made examples and against independent re-computations of the authors'
code (McGill-NLP/VinePPO): step splitting, MC values on a known tree of outcomes, the MC budget, the step cap,
unfinished responses, step advantages, token spreading, whitening, GAE, the PPO clip, the KL term, the ratio guard."""

import math

import numpy as np
import pytest
import torch

from vineppo import (
    UNFINISHED_REWARD,
    aggregate,
    clipped_surrogate,
    gae,
    k3_kl,
    kl_penalty,
    mc_budget,
    mc_state_starts,
    mc_values,
    ratio_guard_trips,
    spread_to_tokens,
    step_advantages,
    step_starts,
    trajectory_reward,
    whiten,
)


# ---------------------------------------------------------------- step splitting (token space)
def test_no_newline_is_one_step():
    assert step_starts(["4", "2", ""]) == [0]  # "42" + EOS (special tokens decode to '')


def test_each_line_starts_a_step():
    texts = ["a", " =", " 1", "\n", "b", " =", " 2", "\n", "#", "###", " 3", ""]
    assert step_starts(texts) == [0, 4, 8]


def test_trailing_newline_and_newline_before_eos_open_no_step():
    assert step_starts(["1", "2", "\n"]) == [0]  # truncated right after a newline
    assert step_starts(["1", "2", "\n", ""]) == [0]  # newline then EOS
    assert step_starts(["1", "\n", "2", "\n", " ", ""]) == [0, 2]  # only whitespace after the last newline


def test_blank_lines_stay_in_the_step_they_end():
    # "x\n\n\ny": the newline tokens form one run; the next step starts at "y"
    assert step_starts(["x", "\n", "\n", "\n", "y"]) == [0, 4]
    assert step_starts(["x", "\n\n", "y"]) == [0, 2]  # a merged "\n\n" token
    assert step_starts(["\n", "x"]) == [0, 1]  # a response that starts with a newline: step 0 is that line
    assert step_starts(["x", ".\n", "  ", "y"]) == [0, 2]  # indentation starts the next step (not a blank line)
    assert step_starts(["x", "\n", "\nThe", " end"]) == [0, 2]  # a newline token with text is a step start


def test_empty_response():
    assert step_starts([]) == [0]


# ---------------------------------------------------------------- MC values on a known tree of outcomes
# The "policy" below answers from a tree: from the prompt it writes line "a\n" or "b\n" with probability 1/2 each;
# after "a\n" it answers "1" (correct) with probability 2/3 and "2" otherwise; after "b\n" it always answers "3"
# (wrong). True values: V(prompt) = 1/2 * 2/3 = 1/3, V(after a) = 2/3, V(after b) = 0. The fake engine returns each
# outcome in exact proportion, so the MC estimates equal the true values.
A, B, NL, ONE, TWO, THREE, EOS = 10, 11, 12, 13, 14, 15, 0
TEXT = {A: "a", B: "b", NL: "\n", ONE: "1", TWO: "2", THREE: "3", EOS: ""}
PROMPT = [100, 101]
TREE = {  # prefix (response part) -> the completions a K=6 sample returns, in exact proportion
    (): [[A, NL, ONE, EOS]] * 2 + [[A, NL, TWO, EOS]] + [[B, NL, THREE, EOS]] * 3,
    (A, NL): [[ONE, EOS]] * 4 + [[TWO, EOS]] * 2,
    (B, NL): [[THREE, EOS]] * 6,
}


def fake_generate(prefixes, n, max_new_tokens):
    """(completion, truncated) pairs, as the engine returns them: cut at max_new_tokens, truncated if cut."""
    out = []
    for p in prefixes:
        comps = TREE[tuple(p[len(PROMPT) :])]
        assert len(comps) == n
        out += [(c[:max_new_tokens], len(c) > max_new_tokens) for c in comps]
    return out


def tree_values(responses, K=6, max_tokens=4):
    states = sorted({tuple(r[:b]) for r in responses for b in step_starts([TEXT[t] for t in r])})

    def reward(j, c):
        return float("".join(TEXT[t] for t in list(states[j]) + c).endswith("1"))

    V, _ = mc_values([(PROMPT + list(st), max_tokens - len(st)) for st in states], K, fake_generate, reward)
    return dict(zip(states, V))


def test_mc_values_of_a_known_tree():
    V = tree_values([[A, NL, ONE, EOS], [B, NL, THREE, EOS]])
    assert V[()] == pytest.approx(1 / 3)
    assert V[(A, NL)] == pytest.approx(2 / 3)
    assert V[(B, NL)] == pytest.approx(0.0)


def test_unfinished_completions_score_the_unfinished_reward():
    """The authors score an MC rollout that hit the length limit with the unfinished-response reward (0), not with
    the verifier. From "a\n" the completions "1 EOS" / "2 EOS" take 2 tokens."""

    def reward(j, c):
        return float(c[0] == ONE)  # the verifier would say "1" is right, EOS or not

    assert mc_values([(PROMPT + [A, NL], 2)], 6, fake_generate, reward) == (pytest.approx([4 / 6]), 0.0)  # they fit
    # a budget of 1 (the trajectory's own limit, with a longer-budget state in the same call): "1" is cut, unfinished
    V, cut_frac = mc_values([(PROMPT + [A, NL], 1), (PROMPT, 4)], 6, fake_generate, lambda j, c: float(ONE in c))
    assert V == pytest.approx([UNFINISHED_REWARD, 1 / 3]) and cut_frac == 6 / 12
    # the engine's own truncation flag (a state at the longest budget) also makes a completion unfinished

    def cut(prefixes, n, T):
        return [([ONE], True)] * (n * len(prefixes))

    assert mc_values([(PROMPT, 1)], 3, cut, lambda j, c: 1.0) == ([UNFINISHED_REWARD], 1.0)


def test_each_state_is_held_to_its_own_budget_in_one_batched_call():
    """One generate call serves states with different token budgets (sampling up to the largest); each state's
    completions are held to its own budget, the tokens its trajectory had left (VinePPO sec. 4: V(s) = (1/K) sum_k
    R(s + c_k), a completion past the budget scoring UNFINISHED_REWARD). From the prompt every completion of the tree
    takes 4 tokens, from "a\n" 2 tokens."""
    states = [((), 3), ((A, NL), 2), ((), 4), ((A, NL), 1)]

    def reward(j, c):
        return float("".join(TEXT[t] for t in [*states[j][0], *c]).endswith("1"))

    V, _ = mc_values([(PROMPT + list(prefix), budget) for prefix, budget in states], 6, fake_generate, reward)
    assert V == pytest.approx([UNFINISHED_REWARD, 4 / 6, 2 / 6, UNFINISHED_REWARD])


@pytest.mark.parametrize("mode", ["remaining", "full"])
def test_mc_budget_rule_decides_which_completions_are_cut(mode):
    """--mc-budget: from a state b response tokens in, a completion of L tokens (EOS included) counts as cut when the
    response it completes, b + L tokens, is longer than max_new_tokens (remaining: the trajectory's own limit), or
    when the completion alone is (full: the authors' fresh max_new_tokens). Checked against that rule written out,
    with an engine that cuts at the T it is asked for and flags those cuts, as the engines do."""
    T, lengths = 6, [1, 2, 3, 4, 5, 6, 7, 9]  # completions ONE * (L - 1) + EOS, one per length
    asked = []

    def engine(prefixes, n, max_new_tokens):
        asked.append(max_new_tokens)
        comps = [[ONE] * (L - 1) + [EOS] for L in lengths] * len(prefixes)
        return [(c[:max_new_tokens], len(c) > max_new_tokens) for c in comps]

    prefixes = [(), (A, NL), (A, NL, B, NL)]
    budgets = [mc_budget(T, len(p), mode) for p in prefixes]
    assert budgets == ([6, 4, 2] if mode == "remaining" else [6, 6, 6])
    states = [(PROMPT + list(p), budget) for p, budget in zip(prefixes, budgets)]
    V, cut_frac = mc_values(states, 8, engine, lambda j, c: 1.0)
    cut = [[(len(p) + L if mode == "remaining" else L) > T for L in lengths] for p in prefixes]
    assert asked == [T]  # one call, every completion sampled up to max_new_tokens fresh tokens
    assert V == pytest.approx([1 - sum(c) / 8 for c in cut])  # a cut completion scores 0 (unfinished), the others 1
    assert cut_frac == sum(map(sum, cut)) / 24
    assert cut_frac == ((2 + 4 + 6) / 24 if mode == "remaining" else 2 * 3 / 24)  # L > T - b, or L > T


def test_truncated_trajectory_scores_the_unfinished_reward():
    assert UNFINISHED_REWARD == 0.0  # the authors' configs: unfinished_response_penalty 0.0
    assert trajectory_reward(1.0, truncated=True) == 0.0 and trajectory_reward(1.0, truncated=False) == 1.0
    assert trajectory_reward(0.0, truncated=False) == 0.0


def test_step_advantages_on_the_tree():
    V = tree_values([[A, NL, ONE, EOS], [B, NL, THREE, EOS]])
    # trajectory "a\n1": A_0 = V(a) - V(root) = 1/3, A_1 = R + 0 - V(a) = 1/3
    assert step_advantages([V[()], V[(A, NL)]], 1.0, 2) == pytest.approx([1 / 3, 1 / 3])
    # trajectory "b\n3": A_0 = V(b) - V(root) = -1/3, A_1 = 0 + 0 - V(b) = 0
    assert step_advantages([V[()], V[(B, NL)]], 0.0, 2) == pytest.approx([-1 / 3, 0.0])
    # the advantages telescope: their sum is R - V(s_0) (gamma = 1, terminal V = 0)
    assert sum(step_advantages([0.3, 0.9, 0.2], 1.0, 3)) == pytest.approx(1.0 - 0.3)


def test_terminal_value_is_zero_and_single_step_is_r_minus_v():
    assert step_advantages([0.25], 1.0, 1) == pytest.approx([0.75])
    assert step_advantages([0.25], 0.0, 1) == pytest.approx([-0.25])


def test_states_beyond_the_cap_use_the_trajectory_return():
    # 4 steps, MC values only for the first 2 states (cap 2): V(s_2) = V(s_3) = R
    R = 1.0
    adv = step_advantages([0.2, 0.6], R, 4)
    V = [0.2, 0.6, R, R, 0.0]
    expected = [0.0 + V[1] - V[0], 0.0 + V[2] - V[1], 0.0 + V[3] - V[2], R + V[4] - V[3]]
    assert adv == pytest.approx(expected)
    assert adv[2:] == [0.0, 0.0]  # the capped steps carry no signal


def authors_step_advantages(n_steps: int, reward: float, mc_value, cap: int) -> list[float]:
    """An independent re-computation of the authors' code (MathEpisodeGeneratorWithMCAdvantages): values has n + 1
    slots (+1 for the query state); value index 0 and step index + 1 for every step index <= min(n - 2, cap - 1) get
    an MC estimate; the terminal slot is 0 and the missing ones are filled from the end with
    step_reward + next value; A_i = step_reward_i + V_{i+1} - V_i with step rewards 0 except the last = R."""
    step_rewards = [0.0] * n_steps
    step_rewards[-1] = reward
    values = [None] * (n_steps + 1)
    values[0] = mc_value(0)
    for step_idx in range(n_steps):
        if step_idx > min(n_steps - 2, cap - 1):
            break
        values[step_idx + 1] = mc_value(step_idx + 1)
    values[-1] = 0.0
    for i in range(n_steps - 1, -1, -1):
        if values[i] is not None:
            break
        values[i] = step_rewards[i] + values[i + 1]
    return [step_rewards[i] + values[i + 1] - values[i] for i in range(n_steps)]


@pytest.mark.parametrize("n_steps", [1, 2, 25, 26, 27, 30, 40])
@pytest.mark.parametrize("cap", [0, 1, 25])
def test_step_cap_and_advantages_match_the_authors(n_steps, cap):
    """--max-steps is the authors' cap: with 25, states s_0 .. s_25 (26 states) get MC values, so on a response of
    >= 26 steps A_24 and A_25 use V(s_25)."""

    def mc_value(i):
        return round(0.1 + 0.8 * ((7 * i) % 11) / 10, 3)  # a distinct made-up estimate per state

    starts = list(range(0, 3 * n_steps, 3))  # step i starts at response token 3i
    estimated = mc_state_starts(starts, cap)
    assert len(estimated) == min(n_steps, cap + 1)
    values = [mc_value(starts.index(b)) for b in estimated]
    for R in (0.0, 1.0):
        assert step_advantages(values, R, n_steps) == pytest.approx(authors_step_advantages(n_steps, R, mc_value, cap))
    if n_steps >= 26 and cap == 25:
        adv = step_advantages(values, 1.0, n_steps)
        assert adv[24] == pytest.approx(mc_value(25) - mc_value(24))  # V(s_25) is an MC estimate, not R
        assert adv[25] == pytest.approx(1.0 - mc_value(25))


def test_spread_to_tokens():
    assert spread_to_tokens([0.5, -1.0, 2.0], [0, 3, 4], 6) == [0.5, 0.5, 0.5, -1.0, 2.0, 2.0]
    assert spread_to_tokens([0.7], [0], 3) == [0.7, 0.7, 0.7]


# ---------------------------------------------------------------- whitening and GAE
def test_whiten_over_masked_entries():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    out = whiten(x, mask)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (v - v.mean()) / v.std(unbiased=True)
    assert out[mask] == pytest.approx(expected.tolist(), abs=1e-6)
    assert out[~mask].tolist() == [0.0, 0.0]


def test_whiten_all_equal_is_zero():
    x = torch.full((2, 3), 0.4)
    out = whiten(x, torch.ones(2, 3, dtype=torch.bool))
    assert torch.all(out == 0)
    assert torch.all(whiten(torch.tensor([[5.0]]), torch.tensor([[True]])) == 0)  # one token


def test_gae_lambda_one_is_return_minus_value():
    torch.manual_seed(0)
    lengths = [3, 5, 1]
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    values = torch.rand(3, 5) * mask
    R = torch.tensor([1.0, 0.0, 1.0])
    rewards = torch.zeros(3, 5)
    rewards[torch.arange(3), torch.tensor(lengths) - 1] = R
    adv = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[mask] == pytest.approx(((R[:, None] - values) * mask)[mask].tolist(), abs=1e-6)
    assert torch.all(adv[~mask] == 0)


def test_gae_general_matches_a_loop():
    torch.manual_seed(1)
    values, rewards = torch.rand(1, 4), torch.rand(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    g, lam = 0.9, 0.8
    v = values[0].tolist() + [0.0]
    deltas = [rewards[0, t].item() + g * v[t + 1] - v[t] for t in range(4)]
    expected = [sum((g * lam) ** (j - t) * deltas[j] for j in range(t, 4)) for t in range(4)]
    assert gae(rewards, values, mask, g, lam)[0].tolist() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------- PPO loss, KL, ratio guard
def test_on_policy_clip_never_fires_and_loss_is_minus_advantage():
    logp = torch.randn(2, 4)
    adv = torch.randn(2, 4)
    loss, ratio, clipped = clipped_surrogate(logp, logp.clone(), adv, 0.2)
    assert torch.allclose(ratio, torch.ones_like(ratio))
    assert not clipped.any()
    assert torch.allclose(loss, -adv)


def test_clip_on_token_advantages():
    logp_behav = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, _, clipped = clipped_surrogate(logp, logp_behav, adv, 0.2)
    # r > 1 + eps with A > 0 and r < 1 - eps with A < 0 are clipped; the other two keep the unclipped (worse) value
    assert clipped.tolist() == [[True, False, False, True]]
    assert loss[0].tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])


def test_k3_is_the_authors_clamped_control_variate():
    """The authors: exp(ref - logp) - (ref - logp) - 1, clamped to [0, 10]; d = logp - ref is not clamped (10.5 gives
    9.5 with gradient 1), and an extreme d gives a finite (zero) gradient."""
    d = torch.tensor([-100.0, -20.0, -2.0, -1.0, 0.0, 1.0, 3.0, 10.5, 11.5, 100.0], dtype=torch.float64)
    expected = np.clip(np.exp(-d.numpy()) + d.numpy() - 1, 0, 10)
    logp = d.clone().requires_grad_(True)
    kl = k3_kl(logp, torch.zeros_like(d))
    assert kl.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert kl[4] == 0 and torch.all(kl >= 0) and kl.max() <= 10
    kl.sum().backward()
    grad = np.where((expected > 0) & (expected < 10), 1 - np.exp(-d.numpy()), 0.0)
    assert torch.isfinite(logp.grad).all() and logp.grad.tolist() == pytest.approx(grad.tolist(), abs=1e-12)


def test_kl_term_is_beta_times_the_mean_over_sequences_of_the_summed_kl():
    """The authors add beta * mean_b sum_t clamp(k3) to the token-mean PPO loss; computed micro-batch by micro-batch
    with the minibatch's sequence count, the parts sum to it, and a token's KL gradient weighs beta / B."""
    torch.manual_seed(0)
    B, T, beta = 6, 5, 1e-4
    lengths = [5, 3, 1, 4, 2, 5]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    logp = (torch.randn(B, T, dtype=torch.float64) - 1).requires_grad_(True)
    ref = torch.randn(B, T, dtype=torch.float64) - 1
    adv = torch.randn(B, T, dtype=torch.float64)
    # independent: numpy, the whole minibatch at once
    d, m = (logp - ref).detach().numpy(), mask.numpy()
    kl_np = np.clip(np.exp(-d) + d - 1, 0, 10) * m
    expected_kl = beta * kl_np.sum(1).mean()
    pg = -adv.numpy() * 1.0  # on-policy: ratio 1, the loss per token is -A
    expected = (pg * m).sum() / m.sum() + expected_kl
    n_tokens = int(mask.sum())
    total = 0.0
    for sl in (slice(0, 2), slice(2, 6)):  # two micro-batches of the minibatch
        loss_tok, _, _ = clipped_surrogate(logp[sl], logp[sl].detach(), adv[sl], 0.2)
        loss = aggregate(loss_tok, mask[sl], "token-mean", None, B, n_tokens) + beta * kl_penalty(
            k3_kl(logp[sl], ref[sl]), mask[sl], B
        )
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(expected, rel=1e-10)
    assert beta * kl_penalty(k3_kl(logp, ref), mask, B).item() == pytest.approx(expected_kl, rel=1e-10)
    # d loss / d logp_t = -A_t / #tokens (PPO) + beta / B * d k3 / d logp_t (where k3 is not clamped)
    dk3 = np.where((kl_np > 0) & (kl_np < 10), 1 - np.exp(-d), 0.0)
    grad = (-adv.numpy() / n_tokens + beta / B * dk3) * m
    assert logp.grad.numpy() == pytest.approx(grad, abs=1e-12)


def test_ratio_guard():
    assert not ratio_guard_trips(torch.ones(8), 10.0)
    assert ratio_guard_trips(torch.tensor([1.0, 1.0, 40.0]), 10.0)  # mean 14 > 10
    assert not ratio_guard_trips(torch.tensor([1.0, 1.0, 25.0]), 10.0)  # mean 9: a single large ratio is not enough
    assert not ratio_guard_trips(torch.zeros(0), 10.0)
    assert math.isclose(torch.tensor([1.0, 1.0, 25.0]).mean().item(), 9.0)
