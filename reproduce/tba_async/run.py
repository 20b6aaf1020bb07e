"""TBA at toy scale: accuracy vs wall-clock against synchronous GRPO, and the effect of the recency probability m.

    python reproduce/tba_async/run.py                   # 5 configurations x 3 seeds = 15 runs of 320 updates
    python reproduce/tba_async/run.py --testbed chain   # the same on the chain testbed, one run at a time
    python reproduce/tba_async/plot.py [--testbed chain]  # -> the PNG and the numbers in README.md

Synchronous GRPO: grpo.py at s = 0 (16 prompts x 8 per rollout batch, 4 updates from each). TBA: tba.py with 4 prompts x
8 per update from its replay buffer (the same 32 samples per update), its searcher free-running (the newest weights at
each round's start, one round ahead: the wall-clock the paper's asynchrony buys, not bit-reproducible), sync period k =
2 (the paper's GSM8K setting) with m in {0.5, 0.95, 1.0}, and k = 16 with the paper's m = 0.95. Same task, lr and budget
as the other figures (sweep.toy_flags). Cores (--cores-per-run): on arithmetic every run has one of the two cores with
another run beside it; on chain one run at a time holds both, TBA's searcher and trainer threads a core each and
synchronous GRPO both cores as intra-op threads, so time/elapsed compares the two ways of using the same machine.
"""

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, figure_csv, parse, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
# configuration label -> (script, staleness / sync period, extra flags, run-name tag)
FREE = ("--free-running",)  # the searcher takes the newest weights at each round: wall-clock, not bit-reproducible
CONFIGS = {
    "GRPO (synchronous)": ("grpo", 0, (), ""),
    "TBA k=2, m=0.5": ("tba", 2, (*FREE, "--recency-prob", "0.5"), "m0.5"),
    "TBA k=2, m=0.95": ("tba", 2, (*FREE, "--recency-prob", "0.95"), "m0.95"),
    "TBA k=2, m=1.0": ("tba", 2, (*FREE, "--recency-prob", "1.0"), "m1.0"),
    "TBA k=16, m=0.95": ("tba", 16, FREE, "free"),  # m = 0.95 is tba.py's default
}
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "losses/entropy",
    "async/staleness_mean",
    "tba/recency_frac",
    "tba/buffer_size",
    "tba/residual_abs_mean",
]


@dataclass
class Args(SweepArgs):
    cores_per_run: int | None = None
    """1: two runs side by side, one core each (searcher and trainer share it); 2: one run at a time on both
    cores, TBA's searcher and trainer on a core each, synchronous GRPO with 2 intra-op threads, whatever --parallel
    says (default: 1 on arithmetic, 2 on chain; the 2-core runs' names end in 2cores, so they never stand in for a
    1-core run)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: tba_async.csv here; with --testbed chain:
    tba_async_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    if args.cores_per_run not in (1, 2):
        raise SystemExit(f"--cores-per-run must be 1 or 2, got {args.cores_per_run}")
    two = args.cores_per_run == 2
    return [
        toy_job(
            models,
            args,
            algo,
            s,
            seed,
            {"config": name},
            extra,
            "_".join(filter(None, (tag, "2cores" if two else ""))),
            threads=2 if two and algo == "grpo" else 1,  # synchronous GRPO: both cores as intra-op threads
        )
        for name, (algo, s, extra, tag) in CONFIGS.items()
        for seed in args.seeds
    ]


if __name__ == "__main__":
    args = parse(Args, {"arithmetic": {"cores_per_run": 1}, "chain": {"cores_per_run": 2}})
    args.out = args.out or figure_csv(HERE, "tba_async", args.testbed)
    if args.cores_per_run == 2:
        args.parallel = 1  # the run holds both cores
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
