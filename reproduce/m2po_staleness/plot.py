"""Draw m2po_staleness.png: (a) accuracy vs update, (b) clipped / masked token fraction over training, (c) M2 before
and after M2PO's masking; print the numbers.

    python reproduce/m2po_staleness/plot.py [--csv m2po_staleness.csv] [--png m2po_staleness.png]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sweep import (
    curves,
    figure,
    final_values,
    markdown_table,
    mean_sd,
    plot_args,
    plot_curves,
    pm,
    read_csv,
    run_means,
    save,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ["GRPO s=0", "GRPO s=256", "no trust region s=256", "M2PO s=0", "M2PO s=256"]


if __name__ == "__main__":
    args = plot_args(os.path.join(HERE, "m2po_staleness.csv"), os.path.join(HERE, "m2po_staleness.png"))
    rows = read_csv(args.csv)
    fig, (acc, frac, m2) = figure(3)
    plot_curves(acc, rows, "config", "eval/accuracy", order=ORDER, scale=100)
    acc.set(title="(a) greedy accuracy", xlabel="optimizer update", ylabel="accuracy on 500 held-out problems (%)")
    # GRPO's clipped tokens vs M2PO's masked tokens (the trust region's footprint): losses/clipfrac in both scripts
    grpo = [dict(r, config=r["config"] + " clipped") for r in rows if r["config"].startswith("GRPO")]
    m2po = [dict(r, config=r["config"] + " masked") for r in rows if r["config"].startswith("M2PO")]
    plot_curves(frac, grpo + m2po, "config", "losses/clipfrac", scale=100)
    frac.set(title="(b) clipped (GRPO) / masked (M2PO) tokens", xlabel="optimizer update", ylabel="% of tokens")
    frac.set_yscale("symlog", linthresh=0.1)
    # M2 of each minibatch (all response tokens) and, for M2PO, the capped M2 of the active-quadrant tokens the trust
    # region bounds (docs/m2po.md); the unconstrained run's M2 for contrast
    m2_rows = []
    for r in rows:
        series = {
            "M2PO s=256": [("M2, all tokens", "m2po/M2"), ("after: active tokens, capped", "m2po/M2_after")],
            "no trust region s=256": [("M2, all tokens", "m2po/M2")],
        }.get(r["config"], [])
        m2_rows += [dict(r, config=f"{r['config']}: {name}", M2=r[key]) for name, key in series if key in r]
    plot_curves(m2, m2_rows, "config", "M2")
    m2.axhline(0.04, color="gray", linestyle="--", linewidth=1, label="threshold tau_M2 = 0.04")
    m2.set(title="(c) second moment M2 of log-ratios", xlabel="optimizer update", ylabel="M2 = mean (log r)^2")
    m2.set_yscale("log")
    for ax in (acc, frac, m2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, args.png)
    final = final_values(rows, "config", "eval/accuracy")
    table = []
    for c in [c for c in ORDER if c in final]:
        frac_c = run_means(rows, "config", c, "losses/clipfrac") if not c.startswith("no") else []
        m2_c = run_means(rows, "config", c, "m2po/M2")
        m2a = run_means(rows, "config", c, "m2po/M2_after") if c.startswith("M2PO") else []
        bound = run_means(rows, "config", c, "m2po/constrained_frac") if c.startswith("M2PO") else []
        table.append(
            [
                c,
                pm(final[c]),
                pm(frac_c, digits=2) if frac_c else "-",
                f"{mean_sd(m2_c)[0]:.4f}" if m2_c else "-",
                f"{mean_sd(m2a)[0]:.4f}" if m2a else "-",
                pm(bound, digits=0) if bound else "-",
            ]
        )
    print(
        markdown_table(
            [
                "configuration",
                "final accuracy (%)",
                "clipped / masked tokens (%)",
                "M2 (all tokens)",
                "M2 after the trust region (active tokens, capped)",
                "micro-batches constrained (%)",
            ],
            table,
        )
    )
    data = curves(rows, "config", "eval/accuracy")
    print("best accuracy (%, mean over seeds):", {c: round(max(data[c][1]) * 100, 1) for c in ORDER if c in data})
