"""Draw side_by_side.png (greedy accuracy vs update, one panel per staleness, and the hypotheses' paired differences)
and print the table of final accuracy and the hypotheses' verdicts (sweep.paired_verdict).

python reproduce/side_by_side/plot.py [--testbed chain] [--csv side_by_side.csv] [--png side_by_side.png]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import (
    Hypothesis,
    check_hypotheses,
    figure,
    final_values,
    hypothesis_table,
    markdown_table,
    plot_args,
    plot_curves,
    plot_paired,
    pm,
    read_csv,
    save,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ALGOS = ["grpo", "dapo", "ppo_stale", "m2po", "dppo", "tba", "vineppo"]


def cell(algo: str, s: int) -> dict:
    return {"algo": algo, "staleness": s}


# the papers' claims on this figure's cells, stated before the runs (README.md); a minus b, seed by seed
HYPOTHESES = [
    Hypothesis(
        "staleness costs GRPO: grpo at s = 256 ends below grpo at s = 0", cell("grpo", 256), cell("grpo", 0), -1
    ),
    Hypothesis("M2PO beats GRPO on stale data: m2po above grpo at s = 256", cell("m2po", 256), cell("grpo", 256), 1),
    Hypothesis("M2PO at s = 256 ends below on-policy GRPO (M2PO: they match)", cell("m2po", 256), cell("grpo", 0), -1),
    Hypothesis(
        "staleness costs M2PO: m2po at s = 256 below s = 0 (M2PO: it does not)", cell("m2po", 256), cell("m2po", 0), -1
    ),
    Hypothesis(
        "the decoupled loss beats GRPO on stale data: ppo_stale above grpo at s = 256",
        cell("ppo_stale", 256),
        cell("grpo", 256),
        1,
    ),
    Hypothesis("staleness costs DAPO: dapo at s = 256 below s = 0", cell("dapo", 256), cell("dapo", 0), -1),
    Hypothesis(
        "staleness costs decoupled PPO: ppo_stale at s = 256 below s = 0",
        cell("ppo_stale", 256),
        cell("ppo_stale", 0),
        -1,
    ),
    Hypothesis(
        "a sync period of 256 costs TBA: tba at k = 256 below s = 0 (TBA: off-policy)",
        cell("tba", 256),
        cell("tba", 0),
        -1,
    ),
    Hypothesis("staleness costs VinePPO: vineppo at s = 256 below s = 0", cell("vineppo", 256), cell("vineppo", 0), -1),
    Hypothesis("DPPO beats GRPO on stale data: dppo above grpo at s = 256", cell("dppo", 256), cell("grpo", 256), 1),
    Hypothesis("staleness costs DPPO: dppo at s = 256 below s = 0", cell("dppo", 256), cell("dppo", 0), -1),
]

if __name__ == "__main__":
    args = plot_args(HERE, "side_by_side")
    rows = read_csv(args.csv)
    stalenesses = sorted({int(r["staleness"]) for r in rows})
    start = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r and r["global_step"] == 0]
    results = check_hypotheses(rows, HYPOTHESES)
    fig, axes = figure(len(stalenesses) + 1, width=4.2)
    for ax, s in zip(axes, stalenesses):
        plot_curves(ax, [r for r in rows if int(r["staleness"]) == s], "algo", "eval/accuracy", order=ALGOS, scale=100)
        ax.set_title(
            f"staleness s = {s}" + (" (tba: sync period k)" if s and any(r["algo"] == "tba" for r in rows) else "")
        )
        ax.set_xlabel("optimizer update")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy accuracy on 500 held-out problems (%)")
    axes[0].legend(fontsize=8)
    for ax in axes[1:-1]:
        ax.sharey(axes[0])
    plot_paired(axes[-1], results)
    save(fig, args.png)
    table = []
    for algo in [a for a in ALGOS if any(r["algo"] == a for r in rows)]:
        cells = []
        for s in stalenesses:
            final = final_values(
                [r for r in rows if r["algo"] == algo and int(r["staleness"]) == s], "algo", "eval/accuracy"
            )
            cells.append(pm(final[algo]) if algo in final else "-")
        table.append([algo, *cells])
    print(
        f"final greedy accuracy (%), mean ± sd over seeds; the toy policy starts at "
        f"{sum(start) / max(len(start), 1) * 100:.1f}%"
    )
    print(markdown_table(["algorithm", *[f"s = {s}" for s in stalenesses]], table))
    print(hypothesis_table(rows, results))
