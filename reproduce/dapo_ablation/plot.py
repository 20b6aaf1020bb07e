"""Draw dapo_ablation.png: (a) final accuracy of each row of the ladder, (b) entropy with and without clip-higher,
(c) the fraction of clipped tokens and (d) of truncated responses over training, per row, (e) the hypothesis's paired
differences; print the table and the hypothesis's verdict (sweep.paired_verdict).

    python reproduce/dapo_ablation/plot.py [--testbed chain] [--csv dapo_ablation.csv] [--png dapo_ablation.png]
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
    mean_sd,
    plot_args,
    plot_curves,
    plot_paired,
    pm,
    read_csv,
    run_means,
    save,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [
    "GRPO",
    "+ overlong filtering",
    "+ clip-higher",
    "+ soft overlong punishment",
    "+ token-level loss",
    "+ dynamic sampling (DAPO)",
]
PAPER = [30, 36, 38, 41, 42, 50]  # DAPO Table 1: AIME 2024 avg@32 of Qwen2.5-32B
# DAPO's claim on this figure's cells, stated before the runs (README.md); a minus b, seed by seed
HYPOTHESES = [Hypothesis("the whole ladder (DAPO) ends above GRPO", {"row": ROWS[-1]}, {"row": ROWS[0]}, 1)]


if __name__ == "__main__":
    args = plot_args(HERE, "dapo_ablation")
    rows = read_csv(args.csv)
    final = final_values(rows, "row", "eval/accuracy")
    start = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r and r["global_step"] == 0]
    results = check_hypotheses(rows, HYPOTHESES)
    fig, (bars, ent, clip, trunc, paired) = figure(5, width=5.2)
    present = [r for r in ROWS if r in final]  # a CSV may hold some rows (the ten-seed chain set: the first and last)
    stats = [mean_sd(final[r]) for r in present]
    bars.bar(
        range(len(present)),
        [m * 100 for m, _ in stats],
        yerr=[sd * 100 for _, sd in stats],
        capsize=3,
        color="tab:blue",
        alpha=0.6,
    )
    for i, r in enumerate(present):
        bars.scatter([i] * len(final[r]), [v * 100 for v in final[r]], color="black", s=10, zorder=3)
    bars.set_xticks(range(len(present)), [r.replace("+ ", "+") for r in present], rotation=25, ha="right", fontsize=8)
    bars.set(
        title=f"(a) final greedy accuracy, from {sum(start) / len(start) * 100:.1f}% (dots: seeds)",
        ylabel="accuracy on 500 held-out problems (%)",
    )
    lo = min(v for r in present for v in final[r]) * 100
    bars.set_ylim(max(0, lo - 10), None)
    # clip-higher's own rows where the CSV has them, else the rows it has (the last one with clip-higher on)
    pair = [r for r in ROWS[1:3] if r in final] or present
    plot_curves(
        ent,
        [r for r in rows if r["row"] in pair],
        "row",
        "losses/entropy",
        order=pair,
        labels={ROWS[1]: "symmetric clip (eps 0.2)", ROWS[2]: "clip-higher (eps_high 0.28)"},
    )
    ent.set(
        title="(b) policy entropy " + ("with and without clip-higher" if pair == ROWS[1:3] else "per row"),
        xlabel="optimizer update",
        ylabel="mean token entropy (nats)",
    )
    ent.legend(fontsize=8)
    # the rows' footprints: tokens the clip removes (clip-higher frees some), responses cut at the budget (what
    # overlong filtering drops and the soft punishment discourages)
    plot_curves(clip, rows, "row", "losses/clipfrac", order=ROWS, scale=100)
    clip.set(title="(c) clipped tokens", xlabel="optimizer update", ylabel="% of tokens")
    plot_curves(trunc, rows, "row", "charts/truncated_frac", order=ROWS, scale=100)
    trunc.set(title="(d) responses cut at the generation budget", xlabel="optimizer update", ylabel="% of responses")
    for ax in (clip, trunc):
        ax.legend(fontsize=7)
    for ax in (bars, ent, clip, trunc):
        ax.grid(alpha=0.3)
    plot_paired(paired, results, "(e) hypothesis: paired differences")
    save(fig, args.png)
    table = []
    for r, paper in zip(ROWS, PAPER):
        if r not in final:
            continue
        filt = run_means(rows, "row", r, "dapo/overlong_filtered_frac")
        pen = run_means(rows, "row", r, "dapo/overlong_penalty_mean")
        kept = [
            k / g
            for k, g in zip(
                run_means(rows, "row", r, "dapo/groups_kept"), run_means(rows, "row", r, "dapo/groups_generated")
            )
        ]
        table.append(
            [
                r,
                pm(final[r]),
                pm(run_means(rows, "row", r, "losses/entropy"), scale=1, digits=3),
                pm(run_means(rows, "row", r, "losses/clipfrac"), digits=2),
                pm(run_means(rows, "row", r, "charts/truncated_frac"), digits=1),
                f"{mean_sd(run_means(rows, 'row', r, 'charts/response_length_mean'))[0]:.1f}",
                f"{mean_sd(filt)[0] * 100:.2f}" if filt else "-",
                f"{mean_sd(pen)[0]:.4f}" if pen else "-",
                f"{mean_sd(kept)[0] * 100:.0f}" if kept and r == ROWS[-1] else "-",
                paper,
            ]
        )
    print(
        markdown_table(
            [
                "row",
                "final accuracy (%)",
                "mean entropy",
                "clipped tokens (%)",
                "truncated responses (%)",
                "mean response length (tokens)",
                "overlong-filtered samples (%)",
                "mean overlong penalty",
                "groups kept by dynamic sampling (%)",
                "paper: AIME avg@32",
            ],
            table,
        )
    )
    print(hypothesis_table(rows, results))
