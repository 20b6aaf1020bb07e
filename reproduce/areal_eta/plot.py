"""Draw areal_eta.png: (a) final accuracy vs eta for naive PPO and the decoupled loss, (b) throughput vs eta, (c) the
hypotheses' paired differences; print the numbers and the hypotheses' verdicts (sweep.paired_verdict).

    python reproduce/areal_eta/plot.py [--testbed chain] [--csv areal_eta.csv] [--png areal_eta.png]
"""

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import (
    Hypothesis,
    check_hypotheses,
    figure,
    final_values,
    hypothesis_table,
    markdown_table,
    mean_sd,
    plot_args,
    plot_paired,
    pm,
    read_csv,
    save,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES_PER_UPDATE = 32  # 16 prompts x 8 samples per batch, 4 updates per batch


def cell(loss: str, eta: int) -> dict:
    return {"part": "accuracy", "loss": loss, "eta": eta}


# AReaL's claims on this figure's cells, stated before the runs (README.md); a minus b, seed by seed
HYPOTHESES = [
    Hypothesis("staleness costs naive PPO: eta = 16 ends below eta = 0", cell("naive", 16), cell("naive", 0), -1),
    Hypothesis(
        "staleness costs the decoupled loss: eta = 16 below eta = 0 (AReaL: it holds)",
        cell("decoupled", 16),
        cell("decoupled", 0),
        -1,
    ),
    Hypothesis("the decoupled loss beats naive PPO at eta = 16", cell("decoupled", 16), cell("naive", 16), 1),
]


def throughput(rows: list[dict], part: str = "throughput") -> dict:
    """{eta: [samples trained per second, per seed]} between each run's first and last logged update, for the runs of
    ``part`` (throughput: bounded mode; baseline: synchronous GRPO, under eta 0)."""
    per = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["part"] == part and "time/elapsed" in r and r["global_step"] > 0:
            per[int(r["eta"])][r["seed"]].append((r["global_step"], r["time/elapsed"]))
    out = {}
    for eta, seeds in per.items():
        out[eta] = []
        for pts in seeds.values():
            (s0, t0), (s1, t1) = min(pts), max(pts)
            out[eta].append((s1 - s0) * SAMPLES_PER_UPDATE / (t1 - t0))
    return out


if __name__ == "__main__":
    args = plot_args(HERE, "areal_eta")
    rows = read_csv(args.csv)
    acc_rows = [dict(r, key=(r["loss"], int(r["eta"]))) for r in rows if r["part"] == "accuracy"]
    final = final_values(acc_rows, "key", "eval/accuracy")
    etas = sorted(e for loss, e in final if loss == "naive" and ("decoupled", e) in final)  # both losses ran
    results = check_hypotheses(rows, HYPOTHESES)
    fig, (acc, thr, paired) = figure(3)
    for loss, label in (("naive", "naive PPO (clip on pi_theta / pi_behav)"), ("decoupled", "decoupled PPO")):
        stats = [mean_sd(final[(loss, e)]) for e in etas]
        acc.errorbar(
            range(len(etas)),
            [m * 100 for m, _ in stats],
            yerr=[sd * 100 for _, sd in stats],
            capsize=3,
            marker="o",
            label=f"{label} (n={len(final[(loss, etas[0])])})",
        )
    acc.set_xticks(range(len(etas)), [str(e) for e in etas])
    acc.set(
        title="(a) final greedy accuracy vs staleness",
        xlabel="eta (policy versions every sample lags)",
        ylabel="accuracy on 500 held-out problems (%)",
    )
    speed = throughput(rows)
    t_etas = sorted(speed)
    stats = [mean_sd(speed[e]) for e in t_etas]
    thr.errorbar(
        range(len(t_etas)),
        [m for m, _ in stats],
        yerr=[sd for _, sd in stats],
        capsize=3,
        marker="o",
        label="bounded mode --max-staleness eta",
    )
    sync = throughput(rows, "baseline").get(0)
    if sync:  # synchronous GRPO on both cores
        sync_mean = mean_sd(sync)[0]
        thr.axhline(sync_mean, color="gray", ls="--", label=f"synchronous GRPO, 2 cores (n={len(sync)})")
    thr.set_xticks(range(len(t_etas)), [str(e) for e in t_etas])
    thr.set(
        title="(b) training throughput",
        xlabel="eta (bound, rollout batches ahead)",
        ylabel="samples trained per second",
    )
    for ax in (acc, thr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    plot_paired(paired, results, "(c) hypotheses: paired differences")
    save(fig, args.png)
    table = [
        [e, pm(final[("naive", e)]), pm(final[("decoupled", e)]), pm(speed[e], scale=1.0) if e in speed else "-"]
        + ([f"{mean_sd(speed[e])[0] / sync_mean:.2f}x" if e in speed else "-"] if sync else [])
        for e in etas
    ]
    header = ["eta", "naive PPO accuracy (%)", "decoupled PPO accuracy (%)", "throughput (samples/s)"]
    print(markdown_table(header + (["vs synchronous GRPO"] if sync else []), table))
    if sync:
        print(f"synchronous GRPO on both cores: {pm(sync, scale=1.0)} samples/s")
    print(hypothesis_table(rows, results))
