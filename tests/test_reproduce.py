"""reproduce/: the sweep helpers (reproduce/sweep.py), every figure's plot script on its committed CSV, and a tiny
version of a run script end to end (runs, CSV, plot, reuse of finished runs)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "reproduce"))

import sweep

FIGURES = ["side_by_side", "m2po_staleness", "areal_eta", "dapo_ablation", "vineppo", "tba_async"]


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_collect_bins_training_rows_and_keeps_eval_rows(tmp_path):
    job = sweep.Job("a", "grpo", ["--seed", "1"], {"algo": "grpo", "seed": 1})
    rows = [{"global_step": 0, "eval/accuracy": 0.3, "time/elapsed": 1.0}]
    rows += [{"global_step": s, "losses/clipfrac": s / 10, "other": 5, "time/elapsed": 1.0 + s} for s in range(1, 7)]
    rows += [{"global_step": 6, "eval/accuracy": 0.5, "time/elapsed": 8.0}]
    write_metrics(tmp_path / "runs" / "a", rows)
    out = sweep.collect([job], tmp_path, ["eval/accuracy", "losses/clipfrac"], bin_size=4)
    evals = [r for r in out if "eval/accuracy" in r]
    train = [r for r in out if "losses/clipfrac" in r]
    assert [(r["global_step"], r["eval/accuracy"], r["time/elapsed"]) for r in evals] == [(0, 0.3, 1.0), (6, 0.5, 8.0)]
    # bins (0, 4] and (4, 8]: the mean of the bin, labelled with its last update and that update's clock
    assert [r["global_step"] for r in train] == [4, 6]
    assert train[0]["losses/clipfrac"] == pytest.approx(0.25) and train[1]["losses/clipfrac"] == pytest.approx(0.55)
    assert train[0]["time/elapsed"] == 5.0 and all(r["algo"] == "grpo" and r["seed"] == 1 for r in out)
    assert all("other" not in r for r in out)


def test_csv_round_trip_curves_and_final_values(tmp_path):
    rows = [
        {
            "algo": a,
            "seed": seed,
            "global_step": step,
            "time/elapsed": 10.0 * step + seed,
            "eval/accuracy": base + 0.01 * step + 0.1 * seed,
        }
        for a, base in (("x", 0.0), ("y", 0.2))
        for seed in (1, 2, 3)
        for step in (0, 10, 20)
    ]
    rows.append({"algo": "x", "seed": 1, "global_step": 30, "eval/accuracy": 0.9})  # only one seed got there
    rows.append({"algo": "x", "seed": 1, "global_step": 5, "losses/clipfrac": 0.1})
    sweep.write_csv(rows, tmp_path / "r.csv")
    back = sweep.read_csv(tmp_path / "r.csv")
    assert len(back) == len(rows) and back[0]["algo"] == "x" and back[0]["eval/accuracy"] == pytest.approx(0.1)
    assert "eval/accuracy" not in back[-1]  # empty cells are dropped
    c = sweep.curves(back, "algo", "eval/accuracy")
    xs, mean, lo, hi, n = c["x"]
    assert xs == [0, 10, 20] and n == 3  # step 30 is left out: one seed only
    assert mean == pytest.approx([0.2, 0.3, 0.4]) and lo == pytest.approx([0.1, 0.2, 0.3])
    assert hi == pytest.approx([0.3, 0.4, 0.5])
    assert sweep.curves(back, "algo", "eval/accuracy", x="time/elapsed")["y"][0] == pytest.approx([2.0, 102.0, 202.0])
    final = sweep.final_values(back, "algo", "eval/accuracy")
    assert sorted(final["y"]) == pytest.approx([0.5, 0.6, 0.7]) and sorted(final["x"]) == pytest.approx([0.4, 0.5, 0.9])
    assert sorted(sweep.final_values(back, "algo", "eval/accuracy", last=2)["y"]) == pytest.approx([0.45, 0.55, 0.65])
    mean, sd = sweep.mean_sd([1.0, 2.0, 3.0])
    assert mean == 2.0 and sd == pytest.approx(1.0) and sweep.mean_sd([4.0]) == (4.0, 0.0)
    assert sweep.pm([0.1, 0.2, 0.3]) == "20.0 ± 10.0"
    assert sweep.markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_toy_flags_and_job_names():
    args = sweep.SweepArgs(updates=7, eval_every=3, eval_size=9, learning_rate=2e-5)
    job = sweep.toy_job({2: "M"}, args, "m2po", 256, 2, {"config": "c"}, ("--no-trust-region",), "notr")
    assert job.name == "m2po_notr_s256_seed2" and job.labels == {"config": "c", "seed": 2}
    assert job.flags() == (
        "--model M --seed 2 --total-updates 7 --learning-rate 2e-05 --eval-every 3 --eval-size 9 "
        "--staleness 256 --group-size 8 --prompts-per-batch 16 --updates-per-batch 4 "
        "--no-trust-region"
    )
    tba = sweep.toy_job({1: "M"}, args, "tba", 2, 1, {})
    assert tba.name == "tba_s2_seed1" and tba.flags().endswith("--group-size 8 --prompts-per-batch 4")
    assert job.command()[1].endswith("algorithms/m2po.py") and job.command()[-2:] == ["--run-name", job.name]
    assert sweep.figure_csv("f", "m2po_staleness", "arithmetic") == os.path.join("f", "m2po_staleness.csv")
    assert sweep.figure_csv("f", "m2po_staleness", "chain") == os.path.join("f", "m2po_staleness_chain.csv")
    chain = sweep.toy_job({2: "C"}, sweep.SweepArgs(testbed="chain"), "grpo", 0, 2, {})  # the chain testbed: own names
    assert chain.name == "chain_grpo_s0_seed2"
    speed = "--gen-batch-size 256 --eval-batch-size 256 --attn-implementation eager"  # chain's speed settings
    assert (
        f"--group-size 8 --task chain --digits 1 --max-new-tokens 128 {speed} --prompts-per-batch 16" in chain.flags()
    )
    dapo = sweep.toy_job({2: "C"}, sweep.SweepArgs(testbed="chain"), "dapo", 0, 2, {})  # overlong buffer: 1/4 budget
    assert f"--max-new-tokens 128 {speed} --overlong-buffer 32 --prompts-per-batch 16" in dapo.flags()
    assert "--overlong-buffer" not in sweep.toy_job({2: "C"}, args, "dapo", 0, 2, {}).flags()
    vine = sweep.toy_job({2: "C"}, sweep.SweepArgs(testbed="chain"), "vineppo", 0, 2, {})  # K = 3 MC completions
    assert f"--max-new-tokens 128 {speed} --mc-samples {sweep.CHAIN_MC_SAMPLES} --prompts-per-batch 16" in vine.flags()
    assert "--mc-samples" not in sweep.toy_job({2: "C"}, args, "vineppo", 0, 2, {}).flags()


def test_run_jobs_refuses_bad_settings_and_runs_with_other_flags(tmp_path):
    job = sweep.Job("a", "grpo", ["--seed", "1"])
    with pytest.raises(ValueError, match="unique"):
        sweep.run_jobs([job, job], tmp_path)
    with pytest.raises(ValueError, match="parallel"):
        sweep.run_jobs([job], tmp_path, parallel=0)
    with pytest.raises(ValueError, match="threads"):
        sweep.run_jobs([sweep.Job("b", "grpo", [], threads=0)], tmp_path)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "done").write_text("3.0")
    (tmp_path / "runs" / "a" / "command.txt").write_text("--seed 2")
    with pytest.raises(ValueError, match="other flags"):
        sweep.run_jobs([job], tmp_path)
    (tmp_path / "runs" / "a" / "command.txt").write_text("--seed 1")
    assert sweep.run_jobs([job], tmp_path) == {"a": 3.0}  # finished with the same flags: reused, not re-run


@pytest.mark.run  # sweep.run_jobs starts grpo.py
def test_run_jobs_stops_on_a_failing_run_with_its_log(tmp_path):
    job = sweep.Job("bad", "grpo", ["--no-such-flag"])
    with pytest.raises(RuntimeError, match="run bad failed") as err:
        sweep.run_jobs([job], tmp_path)
    assert "no-such-flag" in str(err.value) and not (tmp_path / "runs" / "bad" / "done").exists()


# every committed set of results: each figure's arithmetic CSV, its chain CSV where one is committed, and the
# chain set of three seeds at an earlier commit (<name>_chain_3seeds.csv) where its cells are not yet rerun at ten
COMMITTED = [(name, "arithmetic", "") for name in FIGURES] + [
    (name, "chain", kept)
    for name in FIGURES
    for kept in ("", "_3seeds")
    if (ROOT / "reproduce" / name / f"{name}_chain{kept}.csv").exists()
]


@pytest.mark.run
@pytest.mark.parametrize("name,testbed,kept", COMMITTED)
def test_plot_script_draws_the_committed_csv(name, testbed, kept, tmp_path):
    png = tmp_path / f"{name}.png"
    csv = ["--csv", str(ROOT / "reproduce" / name / f"{name}_chain{kept}.csv")] if kept else []
    proc = subprocess.run(
        [sys.executable, str(ROOT / "reproduce" / name / "plot.py"), "--testbed", testbed, *csv, "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "|---|" in proc.stdout  # the table the README carries
    assert_readme_tables_match(name, testbed, proc.stdout, kept)


def table_rows(text: str) -> list[str]:
    """A markdown text's table rows (not the |---| rules), whitespace collapsed and the typographic minus as '-'."""
    rows = [" ".join(line.replace("\u2212", "-").split()) for line in text.splitlines() if line.startswith("|")]
    return [r for r in rows if not set(r) <= set("|-: ")]


def assert_readme_tables_match(name: str, testbed: str, printed: str, kept: str = "") -> None:
    """Every table row the plot prints that its README states (a row of the set's section with the same first cell:
    a configuration, an algorithm, a hypothesis, a header) is the printed row, number for number; at least one row
    is stated. Rows the README leaves out (cells without committed runs) are not checked. The sections: "On the
    chain testbed", "On the chain testbed, three seeds" (kept = "_3seeds") and "On 2-digit addition"."""
    readme = (ROOT / "reproduce" / name / "README.md").read_text()
    head = "## On 2-digit addition" if testbed != "chain" else "## On the chain testbed" + (kept and ", three seeds")
    section = readme[readme.index(head) + len(head) :].split("\n## ")[0]
    stated: dict[str, set] = {}
    for row in table_rows(section):
        stated.setdefault(row.split("|")[1].strip(), set()).add(row)
    checked = [row for row in table_rows(printed) if row.split("|")[1].strip() in stated]
    wrong = [row for row in checked if row not in stated[row.split("|")[1].strip()]]
    assert checked and not wrong, f"{name} ({testbed}): README rows that differ from plot.py's:\n" + "\n".join(wrong)


@pytest.mark.run
def test_tiny_side_by_side_run_writes_a_csv_the_plot_reads(toy_path, tmp_path):
    csv_path, work = tmp_path / "sbs.csv", tmp_path / "work"
    cmd = [
        sys.executable,
        str(ROOT / "reproduce" / "side_by_side" / "run.py"),
        "--model",
        str(toy_path),
        "--algos",
        "grpo",
        "tba",
        "--staleness",
        "0",
        "4",
        "--seeds",
        "1",
        "--updates",
        "4",
        "--eval-every",
        "2",
        "--eval-size",
        "8",
        "--work-dir",
        str(work),
        "--out",
        str(csv_path),
    ]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # a 1-digit policy: 0% on 2 digits
    assert (
        refused.returncode != 0
        and "outside the bands the figures assume (greedy [0.28, 0.38], sampled [0.22, 0.32])" in refused.stderr
    ), refused.stderr[-2000:]
    assert "--any-start" in refused.stderr and not work.exists()  # refused before any run
    cmd.append("--any-start")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING: the starting policies" in proc.stdout and "greedy accuracy 0.000 and sampled" in proc.stdout
    rows = sweep.read_csv(csv_path)
    for algo in ("grpo", "tba"):
        for s in (0, 4):
            mine = [r for r in rows if r["algo"] == algo and r["staleness"] == s and r["seed"] == 1]
            assert sorted(r["global_step"] for r in mine if "eval/accuracy" in r) == [0, 2, 4]
            train = [r for r in mine if "charts/reward_mean" in r]
            assert [r["global_step"] for r in train] == [4] and 0 <= train[0]["charts/reward_mean"] <= 1
            assert all(math.isfinite(r["time/elapsed"]) for r in mine)
            assert (work / "runs" / f"{algo}_s{s}_seed1" / "done").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # finished runs are reused
    assert again.returncode == 0 and "4 runs in" in again.stdout and "(4 already done)" in again.stdout
    png = tmp_path / "sbs.png"
    plot = subprocess.run(
        [
            sys.executable,
            str(ROOT / "reproduce" / "side_by_side" / "plot.py"),
            "--csv",
            str(csv_path),
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert png.exists() and "| grpo |" in plot.stdout and "| tba |" in plot.stdout


def test_only_selects_the_runs_with_every_label():
    jobs = [
        sweep.Job(f"{a}_s{s}_seed{seed}", a, [], {"algo": a, "staleness": s, "seed": seed})
        for a in ("grpo", "m2po")
        for s in (0, 256)
        for seed in (1, 2)
    ]
    assert sweep.select(jobs, []) == jobs
    assert [j.name for j in sweep.select(jobs, ["m2po", "256"])] == ["m2po_s256_seed1", "m2po_s256_seed2"]
    assert len(sweep.select(jobs, ["0"])) == 4  # label values, not seeds
    # values of one label are alternatives, of different labels all required; the jobs keep their order
    assert [j.name for j in sweep.select(jobs, ["256", "0", "m2po"])] == [j.name for j in jobs if j.script == "m2po"]
    assert len(sweep.select(jobs, ["grpo", "m2po"])) == 8
    with pytest.raises(SystemExit, match="no run of this figure has all of these labels; its labels are 0, 256, grpo"):
        sweep.select(jobs, ["m2po", "16"])


def test_start_bands_are_the_toy_policy_defaults():
    sys.path.insert(0, str(ROOT / "reproduce" / "toy"))
    from make_toy_policy import TASK_DEFAULTS

    for testbed in ("arithmetic", "chain"):
        defaults = TASK_DEFAULTS[testbed]
        assert sweep.START_BANDS[testbed] == {"greedy": defaults["band"], "sampled": defaults["sampled_band"]}


def test_start_policies_check_the_bands(monkeypatch, capsys):
    measured = []
    monkeypatch.setattr(sweep, "starting_accuracy", lambda model, n, testbed: measured.append((model, n)) or scores)
    args = sweep.SweepArgs(model="M", eval_size=500)
    bands = sweep.START_BANDS["arithmetic"]
    (g_low, g_high), (s_low, s_high) = bands["greedy"], bands["sampled"]
    # inclusive (B007 misreads this loop: the patched starting_accuracy above returns the loop's current scores)
    for scores in ({"greedy": g_low, "sampled": s_low}, {"greedy": g_high, "sampled": s_high}):  # noqa: B007
        assert sweep.start_policies(args) == {1: "M", 2: "M", 3: "M"}  # --model: one policy, measured once
    assert measured == [("M", 500)] * 2 and "inside the figures' bands" in capsys.readouterr().out
    for scores in (
        {"greedy": 0.095, "sampled": 0.25},
        {"greedy": 0.33, "sampled": 0.17},
        {"greedy": 0.5, "sampled": 0.4},
    ):
        with pytest.raises(SystemExit, match="the starting policies M are outside the bands"):
            sweep.start_policies(args)
        assert (
            f"greedy accuracy {scores['greedy']:.3f} and sampled accuracy {scores['sampled']:.3f}"
            in capsys.readouterr().out
        )
        assert sweep.start_policies(sweep.SweepArgs(model="M", any_start=True)) == {1: "M", 2: "M", 3: "M"}
        assert "WARNING" in capsys.readouterr().out


def test_each_seed_starts_from_its_own_toy_policy(monkeypatch, capsys):
    """Without --model, training seed k starts from the toy policy built with --seed k; each is checked, and the
    error names the ones outside the bands."""
    monkeypatch.setattr(sweep, "toy_policy", lambda seed, testbed: f"{testbed}{seed}")
    scores = {
        "arithmetic1": {"greedy": 0.30, "sampled": 0.25},
        "arithmetic2": {"greedy": 0.36, "sampled": 0.23},
        "arithmetic3": {"greedy": 0.12, "sampled": 0.10},
        "chain1": {"greedy": 0.30, "sampled": 0.18},  # inside chain's bands, below arithmetic's sampled one
    }
    monkeypatch.setattr(sweep, "starting_accuracy", lambda model, n, testbed: scores[model])
    assert sweep.start_policies(sweep.SweepArgs(seeds=[1, 2])) == {1: "arithmetic1", 2: "arithmetic2"}
    with pytest.raises(SystemExit, match="the starting policies arithmetic3 are outside"):
        sweep.start_policies(sweep.SweepArgs(seeds=[1, 2, 3]))
    assert sweep.start_policies(sweep.SweepArgs(seeds=[1], testbed="chain")) == {1: "chain1"}
    job = sweep.toy_job({1: "arithmetic1", 2: "arithmetic2"}, sweep.SweepArgs(), "grpo", 0, 2, {})
    assert job.flags().startswith("--model arithmetic2 --seed 2 ")


def test_run_means_averages_each_seed_over_its_rows():
    rows = [
        {"row": "a", "seed": 1, "x": 1.0},
        {"row": "a", "seed": 1, "x": 3.0},
        {"row": "a", "seed": 2, "x": 5.0},
        {"row": "a", "seed": 2},
        {"row": "b", "seed": 1, "x": 100.0},
    ]
    assert sorted(sweep.run_means(rows, "row", "a", "x")) == [2.0, 5.0]
    assert sweep.run_means(rows, "row", "c", "x") == []


def test_parse_fills_the_testbed_settings(monkeypatch):
    for argv, lr, every in [
        ([], 1e-4, 40),
        (["--testbed", "chain"], 3e-5, 80),
        (["--testbed", "chain", "--learning-rate", "1e-4", "--eval-every", "10"], 1e-4, 10),
    ]:
        monkeypatch.setattr(sys, "argv", ["run.py", *argv])
        args = sweep.parse(sweep.SweepArgs)
        assert (args.learning_rate, args.eval_every) == (lr, every)


def load_run(figure: str):
    """reproduce/<figure>/run.py as a module (its jobs() and Args, without running the sweep)."""
    spec = importlib.util.spec_from_file_location(f"{figure}_run", ROOT / "reproduce" / figure / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


def test_tba_async_on_two_cores_gives_grpo_both_and_its_runs_their_own_names():
    run = load_run("tba_async")
    models = {1: "P1", 2: "P2", 3: "P3"}
    one = run.jobs(run.Args(cores_per_run=1, learning_rate=1e-4, eval_every=40), models)
    assert {j.threads for j in one} == {1} and "grpo_s0_seed1" in {j.name for j in one}  # shared with side_by_side
    two = {j.name: j for j in run.jobs(run.Args(testbed="chain", cores_per_run=2, learning_rate=3e-5), models)}
    assert len(two) == 15 and all("2cores" in name for name in two)
    assert two["chain_grpo_2cores_s0_seed2"].threads == 2  # synchronous: both cores as intra-op threads
    assert two["chain_tba_m0.5_2cores_s2_seed3"].threads == 1  # searcher and trainer threads: a core each
    assert "--recency-prob 0.5" in two["chain_tba_m0.5_2cores_s2_seed3"].flags()
    with pytest.raises(SystemExit, match="cores-per-run"):
        run.jobs(run.Args(cores_per_run=3, learning_rate=1e-4), models)


def test_areal_eta_adds_the_synchronous_baseline_on_both_cores():
    run = load_run("areal_eta")
    models = {1: "P1", 2: "P2", 3: "P3"}
    args = run.Args(testbed="chain", learning_rate=3e-5, eval_every=80, sync_baseline=True)
    accuracy, throughput = run.jobs(args, models)
    assert len(accuracy) == 6 * 2 * 3 and len(throughput) == 6 * 2 + 2
    baseline = [j for j in throughput if j.labels["part"] == "baseline"]
    assert [j.name for j in baseline] == ["chain_grpo_sync_s0_seed1", "chain_grpo_sync_s0_seed2"]
    assert all(
        j.threads == 2 and "--total-updates 96 --learning-rate 3e-05 --eval-every 0" in j.flags() for j in baseline
    )
    ppo_stale = [j for j in accuracy + throughput if j.script == "ppo_stale"]
    assert {j.threads for j in ppo_stale} == {1}  # producer, trainer: a core each
    _, without = run.jobs(run.Args(learning_rate=1e-4, eval_every=40, sync_baseline=False), models)
    assert len(without) == 6 * 2 and all(j.script == "ppo_stale" for j in without)


def test_side_by_side_runs_vineppo_at_the_ends_of_the_range_on_chain(monkeypatch):
    run = load_run("side_by_side")
    for argv, expected in [
        ([], None),
        (["--testbed", "chain"], [0, 256]),
        (["--testbed", "chain", "--vineppo-staleness", "16"], [16]),
    ]:
        monkeypatch.setattr(sys, "argv", ["run.py", *argv])
        assert sweep.parse(run.Args, run.FIGURE_SETTINGS).vineppo_staleness == expected
    models = {1: "P1", 2: "P2", 3: "P3"}
    arithmetic = run.jobs(run.Args(learning_rate=1e-4, eval_every=40), models)
    assert len(arithmetic) == 7 * 4 * 3 and len({j.name for j in arithmetic}) == 84
    chain = run.jobs(run.Args(testbed="chain", learning_rate=3e-5, eval_every=80, vineppo_staleness=[0, 256]), models)
    vineppo = sorted(j.name for j in chain if j.script == "vineppo")
    assert vineppo == sorted(f"chain_vineppo_s{s}_seed{seed}" for s in (0, 256) for seed in (1, 2, 3))
    assert len(chain) == 6 * 4 * 3 + 2 * 3
    assert {j.labels["staleness"] for j in chain if j.script == "tba"} == {0, 16, 64, 256}


def test_vineppo_figure_adds_grpo_on_request_with_side_by_sides_runs():
    run = load_run("vineppo")
    models = {1: "P1", 2: "P2", 3: "P3"}
    chain = {j.name: j for j in run.jobs(run.Args(testbed="chain", learning_rate=3e-5, grpo=True), models)}
    assert sorted(chain) == sorted(
        f"chain_{name}_s0_seed{seed}" for name in ("vineppo", "vineppo_critic", "grpo") for seed in (1, 2, 3)
    )
    assert chain["chain_grpo_s0_seed1"].labels == {"estimator": "GRPO", "seed": 1}
    assert "--value-estimator critic" in chain["chain_vineppo_critic_s0_seed2"].flags()
    assert len(run.jobs(run.Args(learning_rate=1e-4, grpo=False), models)) == 6


def test_m2po_staleness_runs_each_learning_rate_under_its_own_names():
    run = load_run("m2po_staleness")
    assert [sweep.lr_text(lr) for lr in (1e-4, 3e-5, 2.5e-5)] == ["1e-4", "3e-5", "2.5e-5"]
    args = run.Args(testbed="chain", learning_rate=3e-5, eval_every=80, other_learning_rates=[1e-4, 1e-5])
    jobs = run.jobs(args, {1: "P1", 2: "P2", 3: "P3"})
    assert len(jobs) == 6 * 3 + 2 * 5 * 3 and len({j.name for j in jobs}) == len(jobs)
    by_name = {j.name: j for j in jobs}
    main = by_name["chain_grpo_s0_seed1"]  # the main lr keeps the name other figures share
    assert "--learning-rate 3e-05" in main.flags() and main.labels == {"config": "GRPO s=0", "lr": 3e-5, "seed": 1}
    other = by_name["chain_m2po_notr_lr1e-5_s256_seed3"]
    assert "--learning-rate 1e-05" in other.flags() and "--no-trust-region" in other.flags()
    assert not any("m2po_lr" in j.name and "_s0_" in j.name for j in jobs)  # M2PO s=0 only at the main lr
    assert by_name["chain_dppo_s256_seed1"].script == "dppo" and "chain_dppo_lr1e-4_s256_seed2" in by_name


def test_t975_is_students_t_quantile():
    """Against published two-sided 95% critical values, in the table (df <= 30) and beyond it (the expansion)."""
    published = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 19: 2.093, 29: 2.045, 30: 2.042}
    published |= {31: 2.040, 40: 2.021, 50: 2.009, 60: 2.000, 100: 1.984, 120: 1.980, 1000: 1.962}
    for df, t in published.items():
        assert sweep.t975(df) == pytest.approx(t, abs=1e-3), df
    with pytest.raises(ValueError, match="df >= 1"):
        sweep.t975(0)


@pytest.mark.parametrize(
    "diffs,sign,verdict",
    [
        ([1.0, 2.0, 3.0], 1, "undecided, 3 seeds"),  # mean 2, sd 1: 2 +- 4.303 / sqrt(3) * 1 = [-0.48, 4.48]
        ([5.0, 6.0, 7.0, 5.0, 6.0, 7.0, 5.0, 6.0, 7.0, 6.0], 1, "holds"),
        ([5.0, 6.0, 7.0, 5.0, 6.0, 7.0, 5.0, 6.0, 7.0, 6.0], -1, "reversed"),
        ([-5.0, -6.0, -7.0], -1, "holds"),
        ([0.5, -0.5, 0.2, 0.0, 0.3, -0.2, 0.1, -0.1, 0.4, -0.3], 1, "no effect at this scale"),
        ([1.0, 1.0, 1.0], 1, "holds"),  # no spread: the interval is the point 1
        ([3.0], 1, "undecided, 1 seeds"),  # one seed: no interval
        (
            [0.5, 1.9, 1.2, 0.9, 1.5, 1.1, 0.7, 1.6, 1.3, 1.0],
            -1,
            "reversed",
        ),  # excludes 0 and inside +-2: significance first
    ],
)
def test_paired_verdict_applies_the_rule_stated_before_the_runs(diffs, sign, verdict):
    r = sweep.paired_verdict(diffs, sign)
    n = len(diffs)
    mean = sum(diffs) / n
    assert r["mean"] == pytest.approx(mean) and r["n"] == n and r["verdict"] == verdict
    if n > 1:  # the t-interval, computed independently
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        half = {3: 4.303, 10: 2.262}[n] * sd / math.sqrt(n)
        assert (r["lo"], r["hi"]) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert r["agree"] == sum(d * sign > 0 for d in diffs)
    with pytest.raises(ValueError, match="sign"):
        sweep.paired_verdict(diffs, 0)


def test_hypotheses_pair_cells_by_seed_and_report_the_gain_over_each_start():
    """Seeds are matched by number whatever the row order; a seed missing from one cell is left out; the table gives
    each cell's final accuracy and gain over its own start, and the paired difference's CI and verdict."""

    def run(algo, seed, start, final):
        return [
            dict(algo=algo, seed=seed, global_step=0.0, **{"eval/accuracy": start}),
            dict(algo=algo, seed=seed, global_step=320.0, **{"eval/accuracy": final}),
        ]

    rows = run("a", 2.0, 0.30, 0.50) + run("b", 1.0, 0.20, 0.25) + run("a", 1.0, 0.20, 0.30) + run("b", 2.0, 0.30, 0.40)
    rows += run("a", 3.0, 0.25, 0.90)  # no seed 3 for b: not paired
    h = sweep.Hypothesis("a above b", {"algo": "a"}, {"algo": "b"}, 1)
    absent = sweep.Hypothesis("absent", {"algo": "c"}, {"algo": "b"}, 1)
    [(got, r)] = sweep.check_hypotheses(rows, [absent, h])  # a hypothesis keeps its number when one before is absent
    assert got is h and r["diffs"] == [pytest.approx(5.0), pytest.approx(10.0)] and r["agree"] == 2
    assert r["number"] == 2
    assert sweep.seed_values(rows, {"algo": "a"}, step="start") == {1.0: 0.20, 2.0: 0.30, 3.0: 0.25}
    table = sweep.hypothesis_table(rows, [(h, r)])
    # seeds 1 and 2: a 30 / 50 (gains 10 / 20), b 25 / 40 (gains 5 / 10); a - b = 5 / 10: 7.5 +- 12.706 * 3.54 / 1.41
    row = "| H2: a above b | 40.0 ± 14.1 (+15.0 ± 7.1) | 32.5 ± 10.6 (+7.5 ± 3.5) | +7.5 [-24.3, +39.3] | 2/2 |"
    assert row in table
    assert table.rstrip().endswith("undecided, 2 seeds |")
