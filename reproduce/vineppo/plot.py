"""Draw vineppo.png: (a) accuracy vs update and (b) vs wall-clock for MC values (VinePPO), a learned critic (PPO) and,
where the CSV has it, GRPO; (c) each estimator's value against the truth per state (value_prediction_states.csv; on
chain value_prediction_chain_states.csv); (d) the hypotheses' paired differences; print the numbers and the hypotheses'
verdicts (sweep.paired_verdict).

    python reproduce/vineppo/plot.py [--testbed chain] [--csv vineppo.csv] [--png vineppo.png]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import (
    Hypothesis,
    check_hypotheses,
    curves,
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
ORDER = ["MC (VinePPO)", "critic (PPO)", "GRPO"]
# VinePPO's claims on this figure's cells, stated before the runs (README.md); a minus b, seed by seed
HYPOTHESES = [
    Hypothesis(
        "MC values beat a learned critic: MC ends above critic", {"estimator": ORDER[0]}, {"estimator": ORDER[1]}, 1
    ),
    Hypothesis(
        "MC values beat GRPO's group baseline: MC ends above GRPO", {"estimator": ORDER[0]}, {"estimator": ORDER[2]}, 1
    ),
]

if __name__ == "__main__":
    args = plot_args(HERE, "vineppo")
    rows = read_csv(args.csv)
    results = check_hypotheses(rows, HYPOTHESES)
    fig, (upd, wall, val, paired) = figure(4)
    plot_curves(upd, rows, "estimator", "eval/accuracy", order=ORDER, scale=100)
    upd.set(title="(a) accuracy vs updates", xlabel="optimizer update", ylabel="greedy accuracy (%)")
    minutes = [dict(r, minutes=r["time/elapsed"] / 60) for r in rows if "time/elapsed" in r]
    plot_curves(wall, minutes, "estimator", "eval/accuracy", x="minutes", order=ORDER, scale=100)
    wall.set(
        title="(b) accuracy vs wall-clock", xlabel="minutes (1 of 2 CPU cores per run)", ylabel="greedy accuracy (%)"
    )
    # panel (c): value_prediction.py's output for this testbed; its estimator names come from the summary CSV
    study = "value_prediction" + ("" if args.testbed == "arithmetic" else f"_{args.testbed}")
    estimators = [r["estimator"] for r in read_csv(os.path.join(HERE, f"{study}.csv"))]
    states = read_csv(os.path.join(HERE, f"{study}_states.csv"))
    for key, label, marker in (("mc", estimators[0], "o"), ("critic", estimators[1], "x")):
        err = sum(abs(s[key] - s["truth"]) for s in states) / len(states)
        val.scatter(
            [s["truth"] for s in states], [s[key] for s in states], s=14, marker=marker, label=f"{label}: MAE {err:.3f}"
        )
    val.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1)
    model = "135M model" if args.testbed == "arithmetic" else f"{args.testbed} toy policy"
    val.set(title=f"(c) value estimates, {len(states)} states ({model})", xlabel="truth (rollouts)", ylabel="estimate")
    for ax in (upd, wall, val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    plot_paired(paired, results, "(d) hypotheses: paired differences")
    save(fig, args.png)
    final = final_values(rows, "estimator", "eval/accuracy")
    data = curves(rows, "estimator", "eval/accuracy")
    peak_critic = max(data["critic (PPO)"][1])
    clock = curves([r for r in rows if "eval/accuracy" in r], "estimator", "time/elapsed")  # at each evaluation
    table = []
    for e in [e for e in ORDER if e in data]:
        steps, mean = data[e][0], data[e][1]
        reach = next((s for s, m in zip(steps, mean) if m >= peak_critic), None)
        table.append(
            [
                e,
                pm(final[e]),
                f"{max(mean) * 100:.1f}",
                f"{clock[e][1][-1] / 60:.1f}",
                f"{reach:g}" if reach is not None else "not reached",
            ]
        )
    print(
        markdown_table(
            [
                "estimator",
                "final accuracy (%)",
                "peak mean accuracy (%)",
                "wall-clock (min)",
                "first update at the critic's peak",
            ],
            table,
        )
    )
    print(hypothesis_table(rows, results))
