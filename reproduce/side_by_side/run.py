"""All seven algorithms side by side at staleness s in {0, 16, 64, 256}: same toy task, seeds, batch and update
budget.

    python reproduce/side_by_side/run.py                    # 7 algorithms x 4 staleness x 3 seeds = 84 runs
    python reproduce/side_by_side/plot.py                   # -> side_by_side.png, and prints the table
    python reproduce/side_by_side/run.py --testbed chain    # 78 runs: vineppo.py at s = 0 and 256 only

Every run: the toy policy (reproduce/toy), 2-digit addition, lr 1e-4, 32 samples per optimizer update, 320 updates,
greedy eval on 500 held-out problems every 40 updates. The PPO-family scripts (grpo, dapo, ppo_stale, m2po,
dppo, vineppo) generate 16 prompts x 8 samples per rollout batch and take 4 updates from it (M2PO's recipe), with the
exact lag --staleness s. tba.py samples 4 prompts x 8 per update from its replay buffer and uses s as its sync
period k (weights reach the searcher every s updates), its own notion of staleness (docs/tba.md).
"""

import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, figure_csv, parse, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
ALGOS = ["grpo", "dapo", "ppo_stale", "m2po", "dppo", "tba", "vineppo"]
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "charts/response_length_mean",
    "losses/clipfrac",
    "losses/entropy",
    "async/staleness_mean",
]


@dataclass
class Args(SweepArgs):
    algos: list[str] = field(default_factory=lambda: list(ALGOS))
    """algorithm scripts to run"""
    staleness: list[int] = field(default_factory=lambda: [0, 16, 64, 256])
    """staleness values s (exact lag in updates; tba: sync period)"""
    vineppo_staleness: list[int] | None = None
    """the staleness values vineppo.py runs at (default: those of --staleness; on chain 0 and 256 only: its K = 3
    Monte Carlo completions from every step make a chain run 21-37 minutes on one core, so 12 runs would take
    about 2.6 h at 2 at a time; --vineppo-staleness 0 16 64 256 runs the middle columns too)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: side_by_side.csv here; with --testbed chain:
    side_by_side_chain.csv)"""


FIGURE_SETTINGS = {"chain": {"vineppo_staleness": [0, 256]}}  # Args fields set per testbed when not given


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    per_algo = {"vineppo": args.vineppo_staleness or args.staleness}
    return [
        toy_job(models, args, algo, s, seed, {"algo": algo, "staleness": s})
        for algo in args.algos
        for s in per_algo.get(algo, args.staleness)
        for seed in args.seeds
    ]


if __name__ == "__main__":
    args = parse(Args, FIGURE_SETTINGS)
    args.out = args.out or figure_csv(HERE, "side_by_side", args.testbed)
    unknown = sorted(set(args.algos) - set(ALGOS))
    if unknown:
        raise SystemExit(f"unknown --algos {unknown}; choose from {ALGOS}")
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
