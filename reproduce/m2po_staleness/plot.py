"""Draw m2po_staleness.png: (a) accuracy vs update, (b) clipped / masked token fraction over training, (c) M2 before
and after M2PO's masking, all at the figure's main learning rate, and (d) where the CSV has runs at several learning
rates, the final accuracy of each configuration against the learning rate, and (e) the hypotheses' paired
differences; print the numbers and the hypotheses' verdicts (sweep.paired_verdict).

    python reproduce/m2po_staleness/plot.py [--testbed chain] [--csv m2po_staleness.csv] [--png m2po_staleness.png]
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
    lr_text,
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
ORDER = ["GRPO s=0", "GRPO s=256", "no trust region s=256", "M2PO s=0", "M2PO s=256", "DPPO s=256"]
HIGH_LR = 1e-4  # the collapse claim is tested where the drift is largest (the chain set's highest learning rate)


def hypotheses(main_lr: float | None, high_lr: float | None) -> list[Hypothesis]:
    """The M2PO paper's claims on this figure's cells, stated before the runs (README.md), at the main learning rate
    and, for the collapse, at HIGH_LR (a CSV without an lr column: its one learning rate)."""

    def cell(config: str, lr: float | None) -> dict:
        return {"config": config} if lr is None else {"config": config, "lr": lr}

    at, high = (f" (lr {lr_text(lr)})" if lr else "" for lr in (main_lr, high_lr))
    m, h = main_lr, high_lr
    return [
        Hypothesis(f"M2PO beats GRPO at s = 256{at}", cell("M2PO s=256", m), cell("GRPO s=256", m), 1),
        Hypothesis(
            f"M2PO at s = 256 below on-policy GRPO{at} (paper: match)", cell("M2PO s=256", m), cell("GRPO s=0", m), -1
        ),
        Hypothesis(f"staleness costs GRPO{at}", cell("GRPO s=256", m), cell("GRPO s=0", m), -1),
        Hypothesis(
            f"no trust region collapses at s = 256{high}", cell("no trust region s=256", h), cell("GRPO s=0", h), -1
        ),
        Hypothesis(
            f"M2PO beats no trust region at s = 256{high}", cell("M2PO s=256", h), cell("no trust region s=256", h), 1
        ),
        Hypothesis(
            f"DPPO beats no trust region at s = 256{high}", cell("DPPO s=256", h), cell("no trust region s=256", h), 1
        ),
        Hypothesis(f"DPPO beats M2PO at s = 256{high}", cell("DPPO s=256", h), cell("M2PO s=256", h), 1),
    ]


if __name__ == "__main__":
    args = plot_args(HERE, "m2po_staleness")
    everything = read_csv(args.csv)
    # the main learning rate is the one M2PO s=0 ran at (the other configurations also run at --other-learning-rates);
    # a CSV without an lr column holds one learning rate
    lrs = sorted({r["lr"] for r in everything if "lr" in r})
    main_lr = next((r["lr"] for r in everything if r["config"] == "M2PO s=0" and "lr" in r), None)
    rows = [r for r in everything if r.get("lr") == main_lr]
    results = check_hypotheses(everything, hypotheses(main_lr, HIGH_LR if HIGH_LR in lrs else main_lr))
    fig, axes = figure(5 if len(lrs) > 1 else 4)
    acc, frac, m2 = axes[:3]
    plot_curves(acc, rows, "config", "eval/accuracy", order=ORDER, scale=100)
    at = f" (lr {lr_text(main_lr)})" if main_lr else ""
    acc.set(title=f"(a) greedy accuracy{at}", xlabel="optimizer update", ylabel="accuracy on 500 held-out problems (%)")
    # GRPO's clipped tokens vs M2PO's masked tokens (the trust region's footprint): losses/clipfrac in both scripts
    grpo = [dict(r, config=r["config"] + " clipped") for r in rows if r["config"].startswith("GRPO")]
    m2po = [dict(r, config=r["config"] + " masked") for r in rows if r["config"].startswith("M2PO")]
    plot_curves(frac, grpo + m2po, "config", "losses/clipfrac", scale=100)
    frac.set(title=f"(b) clipped (GRPO) / masked (M2PO) tokens{at}", xlabel="optimizer update", ylabel="% of tokens")
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
    m2.set(title=f"(c) second moment M2 of log-ratios{at}", xlabel="optimizer update", ylabel="M2 = mean (log r)^2")
    m2.set_yscale("log")
    # each configuration's final accuracy at every learning rate: the drift the trust region meets grows with the lr
    keyed = [dict(r, key=(r["config"], r.get("lr"))) for r in everything]
    final = final_values(keyed, "key", "eval/accuracy")
    if len(lrs) > 1:
        by_lr = axes[3]
        for c in ORDER:
            points = [(lr, mean_sd(final[(c, lr)])) for lr in lrs if (c, lr) in final]
            if len(points) > 1:
                by_lr.errorbar(
                    [lr for lr, _ in points],
                    [m * 100 for _, (m, _) in points],
                    yerr=[sd * 100 for _, (_, sd) in points],
                    marker="o",
                    capsize=3,
                    color=f"C{ORDER.index(c)}",  # the colours of panel (a)
                    label=c,
                )
        starts = [r["eval/accuracy"] for r in rows if r["global_step"] == 0 and "eval/accuracy" in r]
        if starts:
            by_lr.axhline(100 * sum(starts) / len(starts), color="gray", linestyle=":", linewidth=1, label="start")
        by_lr.set(title="(d) final accuracy vs learning rate", xlabel="learning rate", ylabel="accuracy (%), mean ± sd")
        by_lr.set_xscale("log")
    for ax in axes[:-1]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    plot_paired(axes[-1], results, f"({'e' if len(lrs) > 1 else 'd'}) hypotheses: paired differences")
    save(fig, args.png)
    table = []
    for lr in sorted(lrs, reverse=True) or [None]:  # the learning rates from the largest down
        for c in [c for c in ORDER if (c, lr) in final]:
            group = [r for r in keyed if r["key"] == (c, lr)]
            frac_c = run_means(group, "config", c, "losses/clipfrac") if not c.startswith("no") else []
            m2_c = run_means(group, "config", c, "m2po/M2")
            m2a = run_means(group, "config", c, "m2po/M2_after") if c.startswith("M2PO") else []
            bound = run_means(group, "config", c, "m2po/constrained_frac") if c.startswith("M2PO") else []
            peaks = curves(group, "config", "eval/accuracy")[c]
            table.append(
                ([lr_text(lr)] if lr is not None else [])
                + [
                    c,
                    pm(final[(c, lr)]),
                    f"{max(peaks[1]) * 100:.1f}",
                    pm(frac_c, digits=2) if frac_c else "-",
                    f"{mean_sd(m2_c)[0]:.4f}" if m2_c else "-",
                    f"{mean_sd(m2a)[0]:.4f}" if m2a else "-",
                    pm(bound, digits=0) if bound else "-",
                ]
            )
    print(
        markdown_table(
            (["lr"] if main_lr is not None else [])
            + [
                "configuration",
                "final accuracy (%)",
                "best accuracy (%, mean curve)",
                "clipped / masked tokens (%)",
                "M2 (all tokens)",
                "M2 after the trust region (active tokens, capped)",
                "micro-batches constrained (%)",
            ],
            table,
        )
    )
    print(
        "final accuracy per seed (%):",
        {f"{c} lr {lr_text(lr)}" if lr else c: [round(v * 100, 1) for v in vals] for (c, lr), vals in final.items()},
    )
    print(hypothesis_table(everything, results))
