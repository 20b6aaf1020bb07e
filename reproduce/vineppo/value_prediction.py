# VinePPO's key claim at small scale: how well do Monte Carlo value estimates (K fresh completions) and a learned
# critic predict the true success probability of a state (prompt + partial response)?
# Paper: "VinePPO: Refining Credit Assignment in RL Training of LLMs", arXiv 2410.01679 (sec. 7, value prediction).
# Input: the checkpoint of `algorithms/vineppo.py --value-estimator critic --keep-final-state` (the critic is in the
# training state, not in the model folder a run leaves): its policy defines the states and the
# truth, its critic is one of the two estimators. Docs: docs/vineppo.md ("Value prediction").
import csv
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "algorithms")
)

import numpy as np
import torch
import tyro

from common.checkpoint import load_checkpoint
from common.engine import HFEngine
from common.logprobs import collate
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task
from vineppo import Critic, mc_values


@dataclass
class Args:
    checkpoint: str
    """checkpoint.pt (or its run folder) of a `vineppo.py --value-estimator critic` run"""
    num_prompts: int = 20
    """held-out problems (the first N of the task's eval set)"""
    responses_per_prompt: int = 3
    """responses sampled from the policy per problem; their partial responses are the states"""
    fractions: tuple[float, ...] = (1 / 3, 2 / 3)
    """cut points of each sampled response, as fractions of its length (the prompt state b = 0 is always included)"""
    truth_samples: int = 64
    """rollouts per state for the 'true' success probability"""
    mc_samples: int = 9
    """K: rollouts per state for the MC estimate (VinePPO's K = 9), independent of the truth's rollouts"""
    min_gap: float = 0.1
    """pairs of states (same problem) count for ranking accuracy when their true values differ by at least this"""
    seed: int = 1
    """seed of the sampled responses and of both sets of rollouts"""
    gen_batch_size: int = 256
    """maximum sequences per engine forward pass"""
    out: str | None = None
    """summary CSV path (default: value_prediction.csv next to this script); per-state rows go to <out>_states.csv"""


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1]) if np.ptp(x) > 0 and np.ptp(y) > 0 else float("nan")


def ranking_accuracy(est: np.ndarray, truth: np.ndarray, group: np.ndarray, min_gap: float) -> tuple[float, int]:
    """Fraction of same-group pairs with |truth_i - truth_j| >= min_gap that ``est`` orders like the truth (ties
    1/2)."""
    hits, n = 0.0, 0
    for i in range(len(est)):
        for j in range(i + 1, len(est)):
            if group[i] == group[j] and abs(truth[i] - truth[j]) >= min_gap:
                d = np.sign(est[i] - est[j]) * np.sign(truth[i] - truth[j])
                hits += 1.0 if d > 0 else 0.5 if d == 0 else 0.0
                n += 1
    return (hits / n if n else float("nan")), n


if __name__ == "__main__":
    args = tyro.cli(Args)
    if min(args.num_prompts, args.responses_per_prompt, args.truth_samples, args.mc_samples) < 1:
        raise SystemExit("--num-prompts, --responses-per-prompt, --truth-samples and --mc-samples must be >= 1")
    if any(not 0 < f < 1 for f in args.fractions):
        raise SystemExit(f"--fractions must lie strictly between 0 and 1, got {args.fractions}")
    ckpt = load_checkpoint(args.checkpoint)
    if ckpt.get("critic") is None:
        raise SystemExit(
            f"--checkpoint {args.checkpoint}: no critic in it; pass a checkpoint of "
            f"`vineppo.py --value-estimator critic`"
        )
    run = ckpt["args"]
    torch.manual_seed(args.seed)
    t_start = time.time()
    # ---------------------------------------------------------------- the trained policy and critic of the run
    model_path = resolve_model(run["model"])
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path)
    policy.load_state_dict(ckpt["model"])
    critic = Critic(load_model(model_path))
    critic.load_state_dict(ckpt["critic"])
    critic.eval()
    gen_eos = policy.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
    engine = HFEngine(
        policy,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        dtype=getattr(torch, run["engine_dtype"]),
        max_batch=args.gen_batch_size,
    )
    task = make_task(
        run["task"],
        digits=run["digits"],
        data_path=run["data_path"],
        eval_task=run["eval_task"],
        eval_data_path=run["eval_data_path"],
        eval_size=run["eval_size"],
        prompt_template=run["prompt_template"],
        seed=run["seed"],
    )
    chat = task.chat if run["chat_template"] is None else run["chat_template"]
    rows = task.eval_rows[: args.num_prompts]
    prompts = [encode_prompt(tokenizer, task.prompt(r), chat) for r in rows]
    T = run["max_new_tokens"]
    sampling = dict(temperature=run["temperature"], top_p=run["top_p"])

    # ---------------------------------------------------------------- the states: prompt + partial sampled responses
    outs = engine.generate(prompts, n=args.responses_per_prompt, max_new_tokens=T, seed=args.seed, **sampling)
    states: dict = {}  # (problem, response prefix) -> (problem, full response it came from, b)
    for i, o in enumerate(outs):
        g, resp = i // args.responses_per_prompt, o["response"]
        n_visible = len(resp) - (1 if resp and resp[-1] in eos_ids else 0)  # a prefix never contains the EOS
        for b in [0] + [int(f * n_visible) for f in args.fractions]:
            if b == 0 or 0 < b < n_visible:
                states.setdefault((g, tuple(resp[:b])), (g, resp, b))
    keys = list(states)
    print(
        f"{len(keys)} states from {len(rows)} problems x {args.responses_per_prompt} sampled responses "
        f"(policy of update {ckpt['update']}, temperature {run['temperature']})",
        flush=True,
    )

    # ------------------------------------------------------------- truth and the MC estimate (same policy, fresh seeds)
    def rollout_values(K: int, seed: int) -> np.ndarray:
        def gen(p, n, budget):
            return [
                (o["response"], o["truncated"])
                for o in engine.generate(p, n=n, max_new_tokens=budget, seed=seed, **sampling)
            ]

        def score(j, c):
            return task.reward(tokenizer.decode(list(keys[j][1]) + c, skip_special_tokens=True), rows[keys[j][0]])

        return np.array(mc_values([(prompts[g] + list(r), T - len(r)) for g, r in keys], K, gen, score)[0])

    t0 = time.time()
    truth = rollout_values(args.truth_samples, args.seed * 1_000_003 + 1)
    t_truth = time.time() - t0
    t0 = time.time()
    mc = rollout_values(args.mc_samples, args.seed * 1_000_003 + 2)
    t_mc = time.time() - t0

    # ---------------------------------------------------------------- the critic's value of each state
    t0 = time.time()
    crit = np.zeros(len(keys))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["bf16"]):
        for i in range(0, len(keys), 32):
            chunk = [states[key] for key in keys[i : i + 32]]
            v = critic(
                collate([prompts[g] for g, _, _ in chunk], [resp for _, resp, _ in chunk], tokenizer.pad_token_id)
            )
            crit[i : i + 32] = [v[j, b].item() for j, (_, _, b) in enumerate(chunk)]
    t_critic = time.time() - t0

    # ---------------------------------------------------------------- the table
    group = np.array([g for g, _ in keys])
    constant = np.full(len(keys), truth.mean())
    se = np.sqrt(truth * (1 - truth) / args.truth_samples).mean()
    table = []
    for name, est in (
        (f"MC, K={args.mc_samples}", mc),
        (f"critic (update {ckpt['update']})", crit),
        ("constant (mean truth)", constant),
    ):
        acc, n_pairs = ranking_accuracy(est, truth, group, args.min_gap)
        table.append(
            dict(
                estimator=name,
                mae=float(np.abs(est - truth).mean()),
                pearson=pearson(est, truth),
                ranking_accuracy=acc,
                pairs=n_pairs,
                states=len(keys),
            )
        )
    print(
        f"\ntruth: {args.truth_samples} rollouts per state, mean {truth.mean():.3f}, std {truth.std():.3f}, mean "
        f"standard error {se:.3f}; states {len(keys)} from {len(rows)} problems; {time.time() - t_start:.0f}s "
        f"(truth {t_truth:.0f}s, MC {t_mc:.0f}s, critic {t_critic:.1f}s)"
    )
    print(f"{'estimator':<24} {'MAE':>7} {'Pearson r':>10} {'ranking acc':>12} {'pairs':>6}")
    for r in table:
        print(
            f"{r['estimator']:<24} {r['mae']:>7.3f} {r['pearson']:>10.3f} {r['ranking_accuracy']:>12.3f} "
            f"{r['pairs']:>6}"
        )
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "value_prediction.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    states_out = out[: -len(".csv")] + "_states.csv" if out.endswith(".csv") else out + "_states.csv"
    with open(states_out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["problem", "b", "prefix", "truth", "mc", "critic"])
        for j, (g, r) in enumerate(keys):
            w.writerow([g, len(r), tokenizer.decode(list(r)), f"{truth[j]:.4f}", f"{mc[j]:.4f}", f"{crit[j]:.4f}"])
    print(f"wrote {out} and {states_out}")
