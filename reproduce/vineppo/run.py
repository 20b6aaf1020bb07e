"""VinePPO against PPO with a learned critic at toy scale: accuracy vs updates and vs wall-clock.

    python reproduce/vineppo/run.py                 # 2 value estimators x 3 seeds = 6 runs of 320 updates
    python reproduce/vineppo/plot.py                # -> vineppo.png (with value_prediction_states.csv)

Both are vineppo.py on the same task, batch shape and budget as the other figures (sweep.toy_flags), synchronous
(s = 0) like the paper: --value-estimator mc (K = 9 Monte Carlo completions per reasoning step) against
--value-estimator critic (PPO's value network, GAE lambda = 1). The runs take turns on the same cores, so their
time/elapsed compare. The value-prediction panel comes from value_prediction.py (README.md).
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
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: vineppo.csv here; with --testbed chain:
    vineppo_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    return [toy_job(models, args, "vineppo", 0, seed, {"estimator": "MC (VinePPO)"}) for seed in args.seeds] + [
        toy_job(
            models, args, "vineppo", 0, seed, {"estimator": "critic (PPO)"}, ("--value-estimator", "critic"), "critic"
        )
        for seed in args.seeds
    ]


if __name__ == "__main__":
    args = parse(Args)
    args.out = args.out or figure_csv(HERE, "vineppo", args.testbed)
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
