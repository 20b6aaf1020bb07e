"""Draw side_by_side.png (greedy accuracy vs update, one panel per staleness) and print the table of final accuracy.

python reproduce/side_by_side/plot.py [--testbed chain] [--csv side_by_side.csv] [--png side_by_side.png]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import figure, final_values, markdown_table, plot_args, plot_curves, pm, read_csv, save

HERE = os.path.dirname(os.path.abspath(__file__))
ALGOS = ["grpo", "dapo", "ppo_stale", "m2po", "tba", "vineppo"]

if __name__ == "__main__":
    args = plot_args(HERE, "side_by_side")
    rows = read_csv(args.csv)
    stalenesses = sorted({int(r["staleness"]) for r in rows})
    start = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r and r["global_step"] == 0]
    fig, axes = figure(len(stalenesses), width=4.2, sharey=True)
    for ax, s in zip(axes, stalenesses):
        plot_curves(ax, [r for r in rows if int(r["staleness"]) == s], "algo", "eval/accuracy", order=ALGOS, scale=100)
        ax.set_title(f"staleness s = {s}" + (" (tba: sync period k)" if s else ""))
        ax.set_xlabel("optimizer update")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy accuracy on 500 held-out problems (%)")
    axes[0].legend(fontsize=8)
    save(fig, args.png)
    table = []
    for algo in ALGOS:
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
