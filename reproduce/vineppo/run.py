"""VinePPO against PPO with a learned critic (and GRPO) at toy scale: accuracy vs updates and vs wall-clock.

    python reproduce/vineppo/run.py                 # 2 value estimators x 3 seeds = 6 runs of 320 updates
    python reproduce/vineppo/run.py --testbed chain # the same on the chain testbed, plus GRPO's 3 runs (shared)
    python reproduce/vineppo/plot.py [--testbed chain]  # -> the PNG (with value_prediction[_chain]_states.csv)

All are on the same task, batch shape and budget as the other figures (sweep.toy_flags), synchronous (s = 0) like
the paper: vineppo.py --value-estimator mc (K Monte Carlo completions per reasoning step: the paper's 9 on arithmetic,
sweep.CHAIN_MC_SAMPLES on chain) against --value-estimator critic (PPO's value network, GAE lambda = 1), and on chain
grpo.py (no values at all: one group-normalised advantage per response) as a third line. The runs take turns on the
same cores, so their time/elapsed compare. The value-prediction panel comes from value_prediction.py (README.md).
"""

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, figure_csv, parse, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "losses/entropy",
    "losses/clipfrac",
    "vineppo/mc_time_frac",
    "vineppo/value_std",
    "vineppo/nonzero_adv_frac",
]


@dataclass
class Args(SweepArgs):
    grpo: bool | None = None
    """also run GRPO at s = 0, the same runs as side_by_side's (default: on chain, not on arithmetic)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: vineppo.csv here; with --testbed chain:
    vineppo_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    mc = [toy_job(models, args, "vineppo", 0, seed, {"estimator": "MC (VinePPO)"}) for seed in args.seeds]
    critic = [
        toy_job(
            models, args, "vineppo", 0, seed, {"estimator": "critic (PPO)"}, ("--value-estimator", "critic"), "critic"
        )
        for seed in args.seeds
    ]
    grpo = [toy_job(models, args, "grpo", 0, seed, {"estimator": "GRPO"}) for seed in args.seeds if args.grpo]
    return mc + critic + grpo


if __name__ == "__main__":
    args = parse(Args, {"arithmetic": {"grpo": False}, "chain": {"grpo": True}})
    args.out = args.out or figure_csv(HERE, "vineppo", args.testbed)
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
