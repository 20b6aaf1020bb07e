"""M2PO's staleness figure at toy scale: GRPO at s = 0 and 256, no trust region at s = 256, M2PO at s = 0 and 256,
and DPPO (another trust region for stale data) at s = 256.

    python reproduce/m2po_staleness/run.py                  # 2-digit addition: 6 configurations x 3 seeds, lr 1e-4
    python reproduce/m2po_staleness/run.py --testbed chain  # chain: the same at lr 3e-5, and all but M2PO s=0 at
                                                            # 1e-4 and 1e-5 too (48 runs)
    python reproduce/m2po_staleness/plot.py [--testbed chain]  # -> the PNG and the numbers in README.md

Same task, batch shape and budget as the side-by-side figure (sweep.toy_flags): 16 prompts x 8 samples per rollout
batch, 4 updates from each, exact lag --staleness s, the testbed's learning rate (sweep.TESTBED_SETTINGS), 320
updates; the runs at that learning rate are the same runs as there (shared through --work-dir), those at the other
learning rates carry the lr in their names. "No trust region" is m2po.py --no-trust-region: the plain
importance-weighted policy gradient of the M2PO paper's ablation, no clip and no mask.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, figure_csv, lr_text, parse, run_sweep, start_policies, toy_job

HERE = os.path.dirname(os.path.abspath(__file__))
# configuration label -> (script, staleness, extra flags, run-name tag)
CONFIGS = {
    "GRPO s=0": ("grpo", 0, (), ""),
    "GRPO s=256": ("grpo", 256, (), ""),
    "no trust region s=256": ("m2po", 256, ("--no-trust-region",), "notr"),
    "M2PO s=0": ("m2po", 0, (), ""),
    "M2PO s=256": ("m2po", 256, (), ""),
    "DPPO s=256": ("dppo", 256, (), ""),  # another trust region for stale data: a divergence mask (dppo.py)
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


# the configurations also run at each of --other-learning-rates
LR_SWEEP = ["GRPO s=0", "GRPO s=256", "no trust region s=256", "M2PO s=256", "DPPO s=256"]


@dataclass
class Args(SweepArgs):
    other_learning_rates: list[float] | None = None
    """learning rates besides --learning-rate at which the configurations of LR_SWEEP (all but M2PO s=0) also run, to
    see the trust region at other drifts (default: 1e-4 and 1e-5 with --testbed chain, none on arithmetic)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: m2po_staleness.csv here; with --testbed chain:
    m2po_staleness_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> list[Job]:
    # the main lr runs every configuration under the names the other figures share; each other lr runs those of
    # LR_SWEEP, with the lr in their names
    plan = [(args.learning_rate, "", list(CONFIGS))]
    plan += [(lr, "lr" + lr_text(lr), LR_SWEEP) for lr in args.other_learning_rates]
    out = []
    for lr, lr_tag, names in plan:
        at_lr = dataclasses.replace(args, learning_rate=lr)
        for name in names:
            algo, s, extra, tag = CONFIGS[name]
            labels, run_tag = {"config": name, "lr": lr}, "_".join(filter(None, (tag, lr_tag)))
            out += [toy_job(models, at_lr, algo, s, seed, labels, extra, run_tag) for seed in args.seeds]
    return out


if __name__ == "__main__":
    args = parse(Args, {"arithmetic": {"other_learning_rates": []}, "chain": {"other_learning_rates": [1e-4, 1e-5]}})
    if args.learning_rate in args.other_learning_rates:
        raise SystemExit(
            f"--other-learning-rates {args.other_learning_rates} repeats --learning-rate {args.learning_rate}"
        )
    args.out = args.out or figure_csv(HERE, "m2po_staleness", args.testbed)
    run_sweep(jobs(args, start_policies(args)), args, KEYS, args.out)
