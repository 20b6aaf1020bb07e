"""M2PO's staleness figure at toy scale: GRPO at s = 0 and 256, no trust region at s = 256, M2PO at s = 0 and 256.

    python reproduce/m2po_staleness/run.py          # 5 configurations x 3 seeds = 15 runs of 320 updates
    python reproduce/m2po_staleness/plot.py         # -> m2po_staleness.png and the numbers in README.md

Same task, batch shape and budget as the side-by-side figure (sweep.toy_flags): 16 prompts x 8 samples per rollout
batch, 4 updates from each, exact lag --staleness s, lr 1e-4, 320 updates; the GRPO and M2PO runs are the same runs
as there (shared through --work-dir). "No trust region" is m2po.py --no-trust-region: the plain importance-weighted
policy gradient of the M2PO paper's ablation, no clip and no mask.
"""

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro

from sweep import Job, SweepArgs, figure_csv, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
# configuration label -> (script, staleness, extra flags, run-name tag)
CONFIGS = {
    "GRPO s=0": ("grpo", 0, (), ""),
    "GRPO s=256": ("grpo", 256, (), ""),
    "no trust region s=256": ("m2po", 256, ("--no-trust-region",), "notr"),
    "M2PO s=0": ("m2po", 0, (), ""),
    "M2PO s=256": ("m2po", 256, (), ""),
}
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "losses/clipfrac",
    "losses/entropy",
    "losses/ratio_max",
    "losses/grad_norm",
    "m2po/M2",
    "m2po/M2_after",
    "m2po/constrained_frac",
    "async/staleness_mean",
]


@dataclass
class Args(SweepArgs):
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: m2po_staleness.csv here; with --testbed chain:
    m2po_staleness_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    return [
        toy_job(models, args, algo, s, seed, {"config": name}, extra, tag)
        for name, (algo, s, extra, tag) in CONFIGS.items()
        for seed in args.seeds
    ]


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.out = args.out or figure_csv(HERE, "m2po_staleness", args.testbed)
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
