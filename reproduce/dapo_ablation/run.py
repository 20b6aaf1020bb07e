"""DAPO's ablation ladder at toy scale: GRPO, then each DAPO technique added on top of the previous row.

    python reproduce/dapo_ablation/run.py           # 6 rows x 3 seeds = 18 runs of 320 updates
    python reproduce/dapo_ablation/plot.py          # -> dapo_ablation.png and the table in README.md

Every row is dapo.py with its switches (the first row, all off, is GRPO's objective with DAPO's code path): same
task, batch shape and budget as the other figures (sweep.toy_flags), synchronous (s = 0) like the paper's ablation.
Rows as in DAPO's Table 1: GRPO -> +overlong filtering -> +clip-higher -> +soft overlong punishment -> +token-level
loss -> +dynamic sampling (= DAPO).
"""

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, figure_csv, parse, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
SWITCHES = ["overlong-filtering", "clip-higher", "overlong-shaping", "token-level-loss", "dynamic-sampling"]
ROWS = [
    "GRPO",
    "+ overlong filtering",
    "+ clip-higher",
    "+ soft overlong punishment",
    "+ token-level loss",
    "+ dynamic sampling (DAPO)",
]
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "charts/response_length_mean",
    "charts/truncated_frac",
    "losses/entropy",
    "losses/clipfrac",
    "dapo/overlong_filtered_frac",
    "dapo/overlong_penalty_mean",
    "dapo/groups_kept",
    "dapo/groups_generated",
    "dapo/sampling_rounds",
]


@dataclass
class Args(SweepArgs):
    staleness: int = 0
    """exact lag of every row (the paper's ablation is synchronous)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: dapo_ablation.csv here; with --testbed chain:
    dapo_ablation_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    out = []
    for row, name in enumerate(ROWS):  # row r turns on the first r switches
        extra = tuple(f"--{'' if i < row else 'no-'}{sw}" for i, sw in enumerate(SWITCHES))
        out += [
            toy_job(models, args, "dapo", args.staleness, seed, {"row": name}, extra, f"ladder{row}")
            for seed in args.seeds
        ]
    return out


if __name__ == "__main__":
    args = parse(Args)
    args.out = args.out or figure_csv(HERE, "dapo_ablation", args.testbed)
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
