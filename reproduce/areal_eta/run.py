"""AReaL's staleness study at toy scale: final accuracy vs eta for naive PPO and the decoupled loss; throughput vs eta.

    python reproduce/areal_eta/run.py               # 6 eta x 2 losses x 3 seeds = 36 runs of 320 updates,
                                                    # then 6 eta x 2 seeds throughput runs of 96 updates, one at a time
    python reproduce/areal_eta/plot.py              # -> areal_eta.png and the table in README.md

Accuracy: ppo_stale.py with the exact lag --staleness 4*eta (eta rollout batches of 4 updates each: every sample is
exactly eta policy versions old, the worst case AReaL's bound admits), decoupled loss vs --no-decoupled (the clip on
pi_theta / pi_behav), same task, batch shape and budget as the other figures (sweep.toy_flags).
Throughput: AReaL's bounded mode --max-staleness eta (the producer runs up to eta batches ahead, weights land
mid-generation), one run at a time so its producer and trainer threads have a core each; samples trained per second
of wall-clock between the first and the last update. On chain also synchronous GRPO (grpo.py at s = 0) with both cores
as intra-op threads, the same updates and seeds: the baseline AReaL's speed-up is measured against.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import Job, SweepArgs, collect, figure_csv, parse, run_jobs, select, start_policies, toy_job, write_csv

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = [
    "eval/accuracy",
    "charts/reward_mean",
    "losses/clipfrac",
    "losses/entropy",
    "losses/behav_capped_frac",
    "losses/ratio_max",
    "async/staleness_mean",
    "async/staleness_max",
]


@dataclass
class Args(SweepArgs):
    etas: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16])
    """staleness bounds eta, in rollout batches (policy versions)"""
    throughput_updates: int = 96
    """updates per throughput run (no evaluation)"""
    throughput_seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds of the throughput runs"""
    sync_baseline: bool | None = None
    """also run synchronous GRPO (grpo.py at s = 0) on both cores, 2 intra-op threads, as the throughput baseline,
    with the throughput runs' updates and seeds (default: on chain, not on arithmetic)"""
    out: str = ""
    """the CSV of every run's metrics, which the plot reads (default: areal_eta.csv here; with --testbed chain:
    areal_eta_chain.csv)"""


def jobs(args: Args, models: dict[int, str]) -> tuple[list[Job], list[Job]]:
    accuracy = [
        toy_job(
            models,
            args,
            "ppo_stale",
            4 * eta,
            seed,
            {"part": "accuracy", "loss": loss, "eta": eta},
            () if loss == "decoupled" else ("--no-decoupled",),
            "" if loss == "decoupled" else "naive",
        )
        for loss in ["naive", "decoupled"]
        for eta in args.etas
        for seed in args.seeds
    ]
    short = dataclasses.replace(args, updates=args.throughput_updates, eval_every=0)
    throughput = [
        toy_job(
            models,
            short,
            "ppo_stale",
            0,
            seed,
            {"part": "throughput", "loss": "decoupled", "eta": eta},
            ("--max-staleness", str(eta)),
            f"bounded{eta}",
        )
        for eta in args.etas
        for seed in args.throughput_seeds
    ]
    baseline = [  # synchronous: generation and training take turns, each on both cores
        toy_job(models, short, "grpo", 0, seed, {"part": "baseline", "loss": "grpo", "eta": 0}, (), "sync", threads=2)
        for seed in args.throughput_seeds
        if args.sync_baseline
    ]
    return accuracy, throughput + baseline


if __name__ == "__main__":
    args = parse(Args, {"arithmetic": {"sync_baseline": False}, "chain": {"sync_baseline": True}})
    args.out = args.out or figure_csv(HERE, "areal_eta", args.testbed)
    accuracy, throughput = jobs(args, start_policies(args))
    if args.only:  # one row (or part) of the figure
        picked = {j.name for j in select(accuracy + throughput, args.only)}
        accuracy, throughput = [j for j in accuracy if j.name in picked], [j for j in throughput if j.name in picked]
    seconds = run_jobs(accuracy, args.work_dir, args.parallel)
    seconds.update(run_jobs(throughput, args.work_dir, parallel=1))
    write_csv(collect(accuracy, args.work_dir, KEYS, bin_size=8) + collect(throughput, args.work_dir, KEYS), args.out)
    print(f"wrote {args.out}: {len(seconds)} runs, {sum(seconds.values()) / 60:.1f} run-minutes")
