"""Plumbing shared by the reproduce/<figure>/run.py and plot.py scripts.

The run scripts start the algorithm scripts exactly as a user would (``python algorithms/<algo>.py ...`` in a
subprocess, several at a time, one thread each) and gather what they log (runs/<name>/metrics.jsonl) into one CSV;
the plot scripts read that CSV back and draw mean curves with the spread over seeds. Nothing here touches the
algorithms: every number in a figure comes from the scripts' own metrics.
"""

import csv
import math
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "reproduce" / "toy"))

from common.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from common.tasks import make_task  # noqa: E402
from common.tracking import format_duration, read_metrics  # noqa: E402
from make_toy_policy import TASK_DEFAULTS, default_out, greedy_accuracy, sampled_accuracy  # noqa: E402


@dataclass
class SweepArgs:
    """Settings every figure's run script shares (each adds its own)."""

    testbed: Literal["arithmetic", "chain"] = "arithmetic"
    """the task every run trains and is scored on, with its toy policies: 2-digit addition answered in one line
    (arithmetic), or chained addition and subtraction worked one operation per line (chain; reproduce/toy/README.md)"""
    model: str = ""
    """policy every run starts from (default: for training seed k, the toy policy built with --seed k, built on first
    use, so the spread over seeds includes that of the warm start)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """training seeds (each starts from its own toy policy unless --model is given)"""
    updates: int = 320
    """optimizer updates per run"""
    eval_every: int | None = None
    """updates between greedy evaluations (default: the testbed's, TESTBED_SETTINGS: 40 on arithmetic, 80 on chain)"""
    eval_size: int = 500
    """held-out problems per evaluation"""
    learning_rate: float | None = None
    """AdamW learning rate of every run (default: the testbed's, TESTBED_SETTINGS: 1e-4 on arithmetic, 3e-5 on
    chain)"""
    parallel: int = 2
    """runs at a time (one thread each)"""
    only: list[str] = field(default_factory=list)
    """run and write only the runs with these label values, e.g. --only m2po 256 (one cell of a figure) or --only
    GRPO '+ dynamic sampling (DAPO)' (two rows: values of one label are alternatives); the CSV then holds only those
    runs; default: every run"""
    any_start: bool = False
    """run even when the starting policy's accuracies are outside START_BANDS (the figures' READMEs assume a start
    inside them); a loud warning instead of an error"""
    work_dir: str = "runs/reproduce"
    """where the runs write (runs/<name>/metrics.jsonl, <name>.log); finished runs with the same flags are reused,
    also across figures"""


# Per testbed, the learning rate and evaluation period every figure uses unless told otherwise. chain: lr 3e-5, the
# best of the four learning rates GRPO was tried at from the chain policy (1e-4 and up fall below the start,
# reproduce/toy/README.md); evaluation every 80 updates because one greedy pass over 500 chain problems costs about
# as much as 30 updates.
TESTBED_SETTINGS = {
    "arithmetic": {"learning_rate": 1e-4, "eval_every": 40},
    "chain": {"learning_rate": 3e-5, "eval_every": 80},
}


def parse(cls: type, figure_settings: dict[str, dict] | None = None) -> SweepArgs:
    """``tyro.cli(cls)`` with the testbed's settings where the command line left them (None): its learning rate and
    evaluation period (TESTBED_SETTINGS), and a figure's own fields per testbed (``figure_settings``: {testbed:
    {field: value}})."""
    args = tyro.cli(cls)
    settings = {**TESTBED_SETTINGS[args.testbed], **(figure_settings or {}).get(args.testbed, {})}
    for key, value in settings.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# VinePPO's Monte Carlo completions per state on the chain testbed. A chain response has about 7 steps, so one rollout
# batch of 128 responses has about 900 states: with the paper's K = 9 the completions take 97% of a run, 27 s per
# rollout batch on one core (36 min for 320 updates). K = 3 cuts that threefold, so the figures that run vineppo.py
# fit their time; its values take 4 levels (0, 1/3, 2/3, 1), coarser than the paper's 10 (reproduce/vineppo/).
CHAIN_MC_SAMPLES = 3


def testbed_flags(testbed: str, algo: str = "") -> list[str]:
    """The scripts' flags for a testbed: none for arithmetic (the scripts' defaults); for chain its task, digits and the
    generation budget its toy policy was measured at (make_toy_policy.TASK_DEFAULTS), for dapo.py an overlong buffer
    of a quarter of that budget, the share its default (4 of the 16 tokens) has on arithmetic (the DAPO paper: 4096
    of 20480, a fifth), and for vineppo.py K = 3 Monte Carlo completions per state (CHAIN_MC_SAMPLES). On chain every
    run also generates a whole rollout batch per engine pass, evaluates 256 problems per pass and trains with eager
    attention (the first two change nothing but speed; eager rounds differently from sdpa; reproduce/speed/)."""
    if testbed == "arithmetic":
        return []
    defaults = TASK_DEFAULTS[testbed]
    budget = defaults["eval_max_new_tokens"]
    flags = ["--task", testbed, "--digits", str(defaults["digits"]), "--max-new-tokens", str(budget)]
    flags += ["--gen-batch-size", "256", "--eval-batch-size", "256", "--attn-implementation", "eager"]  # speed/
    if algo == "dapo":
        flags += ["--overlong-buffer", str(budget // 4)]
    if algo == "vineppo":
        flags += ["--mc-samples", str(CHAIN_MC_SAMPLES)]
    return flags


def toy_flags(model: str, args: SweepArgs, seed: int, staleness: int, algo: str = "") -> list[str]:
    """The flags every figure's runs share: the starting policy, testbed, seed, budget, lr, evaluation, staleness and
    batch shape (16 prompts x 8 samples per rollout batch, 4 updates from each = M2PO's recipe; tba.py: 4 prompts x 8
    per update from its replay buffer, so both take 32 samples per optimizer update), and the testbed's flags for
    ``algo`` (testbed_flags)."""
    flags = [
        "--model",
        model,
        "--seed",
        str(seed),
        "--total-updates",
        str(args.updates),
        "--learning-rate",
        str(args.learning_rate),
        "--eval-every",
        str(args.eval_every),
        "--eval-size",
        str(args.eval_size),
        "--staleness",
        str(staleness),
        "--group-size",
        "8",
        *testbed_flags(args.testbed, algo),
    ]
    shape = ["--prompts-per-batch", "4"] if algo == "tba" else ["--prompts-per-batch", "16", "--updates-per-batch", "4"]
    return flags + shape


def lr_text(lr: float) -> str:
    """A learning rate the way the commands write it: 1e-4, 3e-5, 2.5e-5."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def figure_csv(folder: str | Path, name: str, testbed: str) -> str:
    """A figure's CSV in ``folder``: <name>.csv for the arithmetic testbed, <name>_<testbed>.csv for another (so a run
    on the chain testbed never overwrites the committed arithmetic results)."""
    return str(Path(folder) / f"{name}{'' if testbed == 'arithmetic' else '_' + testbed}.csv")


def toy_job(
    models: dict[int, str],
    args: SweepArgs,
    algo: str,
    staleness: int,
    seed: int,
    labels: dict,
    extra: tuple = (),
    tag: str = "",
    threads: int = 1,
) -> "Job":
    """A run of ``algo`` from ``models[seed]`` (start_policies) with toy_flags plus ``extra`` flags, named
    [chain_]<algo>[_<tag>]_s<staleness>_seed<seed> (the tag names the extra flags, so figures that share a
    configuration share the run; the chain testbed's runs carry its name), with ``threads`` intra-op threads."""
    testbed = "" if args.testbed == "arithmetic" else f"{args.testbed}_"
    name = f"{testbed}{algo}{'_' + tag if tag else ''}_s{staleness}_seed{seed}"
    return Job(
        name,
        algo,
        toy_flags(models[seed], args, seed, staleness, algo) + list(extra),
        {**labels, "seed": seed},
        threads,
    )


def select(jobs: list["Job"], only: list[str]) -> list["Job"]:
    """The jobs that match every value in ``only`` (all jobs if empty), a value matching a job whose label (as text,
    seeds excluded) equals it; values of the same label are alternatives (two rows, two configurations), values of
    different labels must all match (m2po and 256). An ``only`` that selects nothing is an error listing the labels
    there are."""
    alternatives: dict[frozenset, set] = defaultdict(set)  # the label keys a value names -> the values naming them
    for value in only:
        keys = frozenset(k for j in jobs for k, v in j.labels.items() if k != "seed" and str(v) == value)
        alternatives[keys].add(value)
    chosen = [
        j for j in jobs if all(any(str(j.labels.get(k)) in vals for k in keys) for keys, vals in alternatives.items())
    ]
    if not chosen:
        labels = sorted({str(v) for j in jobs for k, v in j.labels.items() if k != "seed"})
        raise SystemExit(
            f"--only {' '.join(only)}: no run of this figure has all of these labels; its labels are "
            f"{', '.join(labels)}"
        )
    return chosen


def run_sweep(jobs: list["Job"], args: SweepArgs, keys: list[str], out: str | Path, bin_size: int = 8) -> None:
    """Run the jobs (run_jobs; those picked by --only), then write their metrics to the CSV ``out`` (collect)."""
    jobs = select(jobs, args.only)
    seconds = run_jobs(jobs, args.work_dir, args.parallel)
    write_csv(collect(jobs, args.work_dir, keys, bin_size), out)
    print(
        f"wrote {out}: {len(jobs)} runs, {sum(seconds.values()) / 60:.1f} run-minutes "
        f"(about {sum(seconds.values()) / 60 / args.parallel:.0f} minutes of wall-clock at --parallel "
        f"{args.parallel})"
    )


# The starting policy every figure assumes, per testbed, on its 500 held-out problems: its greedy accuracy and the
# accuracy of one sample per problem at temperature 0.7 (the reward rate RL starts from). These are the toy policy's
# default bands (reproduce/toy/make_toy_policy.py --band, --sampled-band), which its builder trains into on any CPU.
START_BANDS = {
    task: {"greedy": defaults["band"], "sampled": defaults["sampled_band"]} for task, defaults in TASK_DEFAULTS.items()
}


def toy_policy(seed: int, testbed: str = "arithmetic") -> str:
    """Folder of the toy policy of ``testbed`` built with ``--seed seed`` (reproduce/toy/make_toy_policy.py, otherwise
    its defaults), built on first use (minutes; reproduce/toy/README.md)."""
    path = Path(default_out(testbed, seed=seed))
    if not (path / "toy_policy.json").exists():
        print(f"[sweep] building the {testbed} toy policy for seed {seed} in {path} (once, minutes)", flush=True)
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "reproduce" / "toy" / "make_toy_policy.py"),
                "--task",
                testbed,
                "--seed",
                str(seed),
                "--out",
                str(path),
            ],
            check=True,
        )
    return str(path)


def starting_accuracy(model: str, eval_size: int, testbed: str = "arithmetic") -> dict:
    """{greedy, sampled}: accuracy of ``model`` on the first ``eval_size`` held-out problems of ``testbed``, greedy and
    with one sample per problem at temperature 0.7, within the testbed's generation budget, scored as the toy policy's
    builder scores them (the scripts' sampler, bf16 autocast, the task's reward)."""
    defaults = TASK_DEFAULTS[testbed]
    path = resolve_model(model)
    task = make_task(testbed, digits=defaults["digits"], eval_size=eval_size)
    policy, tokenizer, budget = load_model(path), load_tokenizer(path), defaults["eval_max_new_tokens"]
    return {
        "greedy": greedy_accuracy(policy, tokenizer, task, budget),
        "sampled": sampled_accuracy(policy, tokenizer, task, budget, 0.7),
    }


def start_policies(args: SweepArgs) -> dict[int, str]:
    """{training seed: the policy its runs start from}: --model for every seed, else the toy policy built with that
    seed (toy_policy). Each policy's accuracies are checked against START_BANDS first: a start outside them (a toy
    policy built by an older builder, another model) is an error, or with --any-start a loud warning."""
    models = {seed: args.model or toy_policy(seed, args.testbed) for seed in args.seeds}
    wanted = START_BANDS[args.testbed]
    bands = ", ".join(f"{k} [{low}, {high}]" for k, (low, high) in wanted.items())
    outside = []
    for model in sorted(set(models.values())):
        scores = starting_accuracy(model, args.eval_size, args.testbed)
        measured = (
            f"greedy accuracy {scores['greedy']:.3f} and sampled accuracy {scores['sampled']:.3f} "
            f"(temperature 0.7) on {args.eval_size} held-out problems"
        )
        inside = all(low <= scores[k] <= high for k, (low, high) in wanted.items())
        print(
            f"[sweep] starting policy {model}: {measured}, {'inside' if inside else 'OUTSIDE'} the figures' bands "
            f"({bands})",
            flush=True,
        )
        outside += [] if inside else [model]
    if not outside:
        return models
    message = f"the starting policies {', '.join(outside)} are outside the bands the figures assume ({bands})"
    if not args.any_start:
        raise SystemExit(
            f"{message}. Rebuild them (python reproduce/toy/make_toy_policy.py --task {args.testbed} --seed <k> "
            f"--out <folder> --overwrite, which trains into those bands), or pass --any-start to run anyway."
        )
    print(
        f"[sweep] WARNING: {message}; running anyway (--any-start): the figures' READMEs do not describe such a start.",
        flush=True,
    )
    return models


@dataclass
class Job:
    """One run of one algorithm script: ``python algorithms/<script>.py <args> --run-name <name>``."""

    name: str
    """run folder name, unique within a sweep"""
    script: str
    """algorithm script without .py: grpo, dapo, ppo_stale, m2po, dppo, tba, vineppo"""
    args: list[str]
    """its command-line flags"""
    labels: dict = field(default_factory=dict)
    """columns every CSV row of this run carries (config name, seed, ...)"""
    threads: int = 1
    """intra-op threads of its process (OMP_NUM_THREADS): 1 lets each of a run's Python threads (producer, trainer)
    keep one core; 2 gives a synchronous run both cores"""

    def flags(self) -> str:
        """The flags as one line (recorded in runs/<name>/command.txt: a finished run is reused only by a job
        with the same flags)."""
        return " ".join(self.args)

    def command(self) -> list[str]:
        return [sys.executable, str(ROOT / "algorithms" / f"{self.script}.py"), *self.args, "--run-name", self.name]


def run_jobs(jobs: list[Job], work_dir: str | Path, parallel: int = 2) -> dict[str, float]:
    """Run the jobs in ``work_dir`` (each writes work_dir/runs/<name>/), ``parallel`` at a time, each with
    OMP_NUM_THREADS=its ``threads``; returns each job's wall-clock seconds. A job that finished in an earlier call (its
    runs/<name>/done marker) with the same flags is skipped, so re-running a sweep resumes it and figures that
    share a configuration share its runs; the same name with other flags is an error. A job that did not finish
    starts again in an emptied folder. A failing job stops the sweep
    with the tail of its log."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got duplicates in {names}")
    if parallel < 1 or any(j.threads < 1 for j in jobs):
        raise ValueError(f"parallel ({parallel}) and every job's threads must be >= 1")
    work_dir = Path(work_dir)
    (work_dir / "runs").mkdir(parents=True, exist_ok=True)
    seconds, todo, running = {}, [], []
    for j in jobs:
        run_dir = work_dir / "runs" / j.name
        if (run_dir / "done").exists():
            recorded = (run_dir / "command.txt").read_text() if (run_dir / "command.txt").exists() else None
            if recorded != j.flags():
                raise ValueError(
                    f"{run_dir} finished with other flags ({recorded!r}) than this sweep's "
                    f"({j.flags()!r}): delete that folder or pass another --work-dir"
                )
            seconds[j.name] = float((run_dir / "done").read_text())
        else:
            todo.append(j)
    t_start, total = time.time(), len(todo)
    print(
        f"[sweep] {len(jobs)} runs in {work_dir} ({len(jobs) - total} already done), {parallel} at a time", flush=True
    )
    while todo or running:
        while todo and len(running) < parallel:
            j = todo.pop(0)
            shutil.rmtree(work_dir / "runs" / j.name, ignore_errors=True)  # an unfinished attempt's files: the
            (work_dir / "runs" / j.name).mkdir()  # scripts refuse a folder that holds a run, so it starts afresh
            (work_dir / "runs" / j.name / "command.txt").write_text(j.flags())
            log = open(work_dir / f"{j.name}.log", "w")
            env = {**os.environ, "OMP_NUM_THREADS": str(j.threads), "MKL_NUM_THREADS": str(j.threads)}
            proc = subprocess.Popen(j.command(), cwd=work_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((j, proc, log, time.time()))
        time.sleep(0.2)
        for item in list(running):
            j, proc, log, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            if proc.returncode != 0:
                for _, other, _, _ in running:
                    other.kill()
                tail = (work_dir / f"{j.name}.log").read_text()[-3000:]
                raise RuntimeError(f"run {j.name} failed (exit {proc.returncode}): {' '.join(j.command())}\n{tail}")
            seconds[j.name] = time.time() - t0
            (work_dir / "runs" / j.name / "done").write_text(f"{seconds[j.name]:.1f}")
            finished = total - len(todo) - len(running)
            print(
                f"[sweep] {finished}/{total} {j.name} {seconds[j.name]:.0f}s "
                f"(sweep {format_duration(time.time() - t_start)})",
                flush=True,
            )
    return seconds


def collect(jobs: list[Job], work_dir: str | Path, keys: list[str], bin_size: int = 1) -> list[dict]:
    """One CSV row per logged step of every job: its labels, ``global_step``, and the ``keys`` it logged there.
    Training metrics are averaged over bins of ``bin_size`` updates (the row carries the bin's last update and the
    ``time/elapsed`` of that update); steps with an evaluation get their own row with the eval keys."""
    rows = []
    for j in jobs:
        metrics = read_metrics(Path(work_dir) / "runs" / j.name / "metrics.jsonl")
        bins: dict[int, list[dict]] = defaultdict(list)
        for m in metrics:
            step = m["global_step"]
            if any(k.startswith("eval/") for k in m):
                rows.append(
                    {
                        **j.labels,
                        "global_step": step,
                        "time/elapsed": m.get("time/elapsed"),
                        **{k: m[k] for k in keys if k.startswith("eval/") and k in m},
                    }
                )
            train = {k: m[k] for k in keys if not k.startswith("eval/") and k in m}
            if train and step > 0:
                bins[math.ceil(step / bin_size) * bin_size].append(
                    {**train, "_step": step, "_elapsed": m.get("time/elapsed")}
                )
        for _end, items in sorted(bins.items()):
            row = {**j.labels, "global_step": items[-1]["_step"], "time/elapsed": items[-1]["_elapsed"]}
            for k in keys:
                vals = [it[k] for it in items if k in it and it[k] is not None]
                if vals:
                    row[k] = sum(vals) / len(vals)
            rows.append(row)
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    """Write rows (dicts, possibly with different keys) as one CSV; columns in first-seen order."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def read_csv(path: str | Path) -> list[dict]:
    """Read a CSV written by write_csv; numbers come back as floats, empty cells are dropped."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v == "":
                    continue
                try:
                    row[k] = float(v)
                except ValueError:
                    row[k] = v
            out.append(row)
    return out


def curves(rows: list[dict], group: str, y: str, x: str = "global_step") -> dict:
    """{group value: (xs, mean, min, max, n_seeds)} of ``y`` over the rows that have ``y``, the statistics taken
    across seeds at each ``global_step``; xs is the mean of ``x`` over the seeds there (x = time/elapsed gives
    accuracy against wall-clock). Steps that not every seed logged are left out."""
    by: dict = defaultdict(lambda: defaultdict(list))
    seeds: dict = defaultdict(set)
    for r in rows:
        if y in r and x in r:
            by[r[group]][r["global_step"]].append((r[x], r[y]))
            seeds[r[group]].add(r.get("seed"))
    out = {}
    for g, points in by.items():
        n = len(seeds[g])
        steps = sorted(k for k, v in points.items() if len(v) == n)
        ys = [[p[1] for p in points[k]] for k in steps]
        out[g] = (
            [sum(p[0] for p in points[k]) / n for k in steps],
            [sum(v) / n for v in ys],
            [min(v) for v in ys],
            [max(v) for v in ys],
            n,
        )
    return out


def final_values(rows: list[dict], group: str, y: str, last: int = 1) -> dict:
    """{group value: [per-seed value]}: each seed's mean of ``y`` over its ``last`` logged values (by global_step)."""
    per: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if y in r:
            per[r[group]][r.get("seed")].append((r["global_step"], r[y]))
    return {
        g: [sum(v for _, v in sorted(pts)[-last:]) / min(last, len(pts)) for pts in seeds.values()]
        for g, seeds in per.items()
    }


def run_means(rows: list[dict], group: str, value, y: str) -> list[float]:
    """Per seed of the rows whose ``group`` column is ``value``: the mean of ``y`` over all its rows (for training
    metrics, the mean over the whole run)."""
    per: dict = defaultdict(list)
    for r in rows:
        if r[group] == value and y in r:
            per[r.get("seed")].append(r[y])
    return [sum(v) / len(v) for v in per.values()]


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, sd


# ---------------------------------------------------------------- the figures' decision rule (fixed before the runs)
NO_EFFECT = 2.0  # points: a 95% CI of the mean paired difference within +-this is "no effect at this scale"
# Student's t, 97.5% quantile, df = 1..30 (two-sided 95% intervals)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (a table to 30, then the Cornish-Fisher
    expansion around the normal quantile, within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"a t-interval needs df >= 1 (two seeds or more), got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_verdict(diffs: list[float], sign: int, no_effect: float = NO_EFFECT) -> dict:
    """The decision rule every figure states before its runs, on one hypothesis's paired differences (cell a minus
    cell b, seed by seed, in points; ``sign`` +1 if the hypothesis says a ends above b, -1 below): the mean difference
    and its 95% t-interval over the seeds, mean +- t975(n - 1) * sd / sqrt(n). A CI that excludes 0 on the
    hypothesis's side: "holds"; on the other: "reversed"; a CI within +-no_effect: "no effect at this scale";
    otherwise "undecided, n seeds" (so with one seed). ``agree``: seeds whose difference has the hypothesis's sign."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 (a above b) or -1 (a below b), got {sign}")
    n = len(diffs)
    mean, sd = mean_sd(diffs)
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    lo, hi = mean - half, mean + half
    if lo > 0 or hi < 0:
        verdict = "holds" if (lo > 0) == (sign > 0) else "reversed"
    elif -no_effect <= lo and hi <= no_effect:
        verdict = "no effect at this scale"
    else:
        verdict = f"undecided, {n} seeds"
    return dict(n=n, mean=mean, lo=lo, hi=hi, agree=sum(d * sign > 0 for d in diffs), verdict=verdict, diffs=diffs)


@dataclass
class Hypothesis:
    """A paper's claim as a test on two named cells of a figure: ``a`` ends above (sign +1) or below (-1) ``b``. A
    cell is the CSV rows whose columns equal the given values (e.g. {"algo": "m2po", "staleness": 256})."""

    claim: str
    a: dict
    b: dict
    sign: int


def seed_values(rows: list[dict], cell: dict, y: str = "eval/accuracy", step: str = "final") -> dict:
    """{seed: the cell's ``y`` at its last logged global_step ("final") or at global_step 0 ("start")}."""
    out: dict = {}
    mine = [r for r in rows if y in r and all(r.get(k) == v for k, v in cell.items())]
    for r in sorted(mine, key=lambda r: r["global_step"]):
        if step == "final" or r["global_step"] == 0:
            out[r["seed"]] = r[y]
    return out


def check_hypotheses(rows: list[dict], hypotheses: list[Hypothesis], scale: float = 100.0) -> list[tuple]:
    """(hypothesis, paired_verdict of its final greedy accuracies, in points) for each hypothesis whose two cells
    share seeds in ``rows``; the others are left out. ``number``: the hypothesis's place in ``hypotheses`` from 1,
    so H5 keeps its name in a set of results that lacks H4's cells."""
    out = []
    for number, h in enumerate(hypotheses, 1):
        a, b = seed_values(rows, h.a), seed_values(rows, h.b)
        seeds = sorted(set(a) & set(b))
        if seeds:
            verdict = paired_verdict([(a[k] - b[k]) * scale for k in seeds], h.sign)
            out.append((h, dict(verdict, seeds=seeds, number=number)))
    return out


def hypothesis_table(rows: list[dict], results: list[tuple]) -> str:
    """The markdown table of a figure's hypotheses, under a heading line: each cell's final accuracy and gain over its
    seeds' own start (mean +- sd, %, over the paired seeds), the mean paired difference with its 95% CI, the seeds
    in the hypothesis's direction, the verdict."""
    table = []
    for h, r in results:
        cells = []
        for cell in (h.a, h.b):
            final, start = seed_values(rows, cell), seed_values(rows, cell, step="start")
            gain = [final[k] - start[k] for k in r["seeds"]]
            sign = "+" if mean_sd(gain)[0] >= 0 else ""
            cells.append(f"{pm([final[k] for k in r['seeds']])} ({sign}{pm(gain)})")
        ci = f"{r['mean']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}]" if r["n"] > 1 else f"{r['mean']:+.1f}"
        table.append([f"H{r['number']}: {h.claim}", *cells, ci, f"{r['agree']}/{r['n']}", r["verdict"]])
    header = ["hypothesis", "a: final (gain)", "b: final (gain)", "a - b, 95% CI (points)", "seeds agreeing"]
    heading = "hypotheses (final greedy accuracy, %; gain: final - the seed's own start):\n"
    return heading + markdown_table([*header, "verdict"], table)


def plot_paired(ax, results: list[tuple], title: str = "hypotheses: paired differences") -> None:
    """A panel of the hypotheses' paired differences (points): each seed's difference, the mean with its 95% CI,
    0 and the no-effect band; H1 at the top."""
    for i, (_, r) in enumerate(results):
        y = len(results) - 1 - i
        ax.scatter(r["diffs"], [y] * r["n"], s=10, color="grey", alpha=0.6, zorder=2)
        if r["n"] > 1:
            ax.errorbar(
                r["mean"], y, xerr=[[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]], fmt="o", color="C3", capsize=3
            )
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvspan(-NO_EFFECT, NO_EFFECT, color="C2", alpha=0.12, label=f"no effect (+-{NO_EFFECT:g})")
    ax.set_yticks(range(len(results)), [f"H{r['number']}" for _, r in reversed(results)])
    ax.set_xlabel("a - b, final greedy accuracy (points): seeds, mean, 95% CI")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")


def plot_curves(
    ax,
    rows: list[dict],
    group: str,
    y: str,
    x: str = "global_step",
    order: list | None = None,
    labels: dict | None = None,
    scale: float = 1.0,
) -> None:
    """Mean of ``y`` over seeds per group as a line, the min-max range over seeds as a band."""
    data = curves(rows, group, y, x)
    for g in order or sorted(data):
        if g not in data:
            continue
        xs, mean, lo, hi, n = data[g]
        name = (labels or {}).get(g, g)
        (line,) = ax.plot(xs, [v * scale for v in mean], label=f"{name} (n={n})")
        if n > 1:
            ax.fill_between(
                xs, [v * scale for v in lo], [v * scale for v in hi], color=line.get_color(), alpha=0.2, linewidth=0
            )


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table (the plot scripts print theirs; the READMEs carry them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def pm(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """'mean ± sd (n)' of values times ``scale`` (percent by default)."""
    mean, sd = mean_sd(values)
    return f"{mean * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def plot_args(folder: str | Path, name: str):
    """Parse the plot scripts' flags: --testbed (which set of results), --csv (the run script's output; default: the
    committed CSV of that testbed, figure_csv) and --png (where the figure goes; default: the CSV's name as .png)."""
    import argparse

    parser = argparse.ArgumentParser(description="draw the figure from the CSV its run.py wrote")
    parser.add_argument("--testbed", default="arithmetic", choices=list(TASK_DEFAULTS), help="results of which testbed")
    parser.add_argument("--csv", default=None, help="results CSV (default: the committed one of --testbed)")
    parser.add_argument("--png", default=None, help="figure to write (default: the committed one of --testbed)")
    args = parser.parse_args()
    args.csv = args.csv or figure_csv(folder, name, args.testbed)
    args.png = args.png or str(Path(args.csv).with_suffix(".png"))
    return args


def figure(n_panels: int, width: float = 4.6, height: float = 3.6, sharey: bool = False):
    """A row of ``n_panels`` matplotlib axes (headless backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False, sharey=sharey)
    return fig, list(axes[0])


def save(fig, png: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
