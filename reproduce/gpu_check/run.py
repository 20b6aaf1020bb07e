"""A check of the GPU paths on one GPU, with what a bare GPU machine has: torch and transformers (no vLLM, no
internet, no default model). It builds its models from configs and runs the algorithm scripts as a user would.

    python reproduce/gpu_check/run.py          # one GPU: the full form (a few minutes)
    python reproduce/gpu_check/run.py --cpu    # the reduced form on CPUs (what a machine without a GPU runs)

1. each of the seven scripts with --cuda for a few updates on a tiny toy policy (m2po.py at staleness 2): exit 0,
   the trainer on the GPU, every update logged with finite metrics in runs/<name>/metrics.jsonl;
2. ``torchrun --nproc-per-node 1`` of grpo.py: the same run as the plain one;
3. grpo.py interrupted (--debug-interrupt-at) and resumed (--resume) equals the uninterrupted run;
4. trainer tokens/s and HF-engine generated tokens/s of grpo.py on a randomly initialised model of
   Qwen2.5-0.5B's shape (bf16 autocast trainer, bf16 engine).

Without a GPU (or with --cpu) it says so and runs the same sequence on CPUs in a reduced form: the speed step on a
2-layer Qwen2 of the same vocabulary and heads instead of the 0.5B shape. It prints a table of the checks and exits
non-zero if any failed. Runs and models go to a temporary folder (--workdir to choose it), removed after a pass.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import tyro

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {  # each script's flags on the tiny policy (besides TINY): fast settings, one run at staleness > 0
    "grpo.py": [],
    "dapo.py": ["--max-sampling-rounds", "50"],  # room to fill a batch with groups that have a reward spread
    "m2po.py": ["--staleness", "2"],
    "dppo.py": [],
    "ppo_stale.py": [],
    "tba.py": [],
    "vineppo.py": ["--mc-samples", "2"],
}
TINY = [
    "--digits",
    "1",
    "--prompts-per-batch",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "6",
    "--eval-size",
    "8",
    "--eval-every",
    "2",
]
RESUME = ["--staleness", "2", "--updates-per-batch", "2", "--total-updates", "6"]  # interrupted mid-batch at 3
INTERRUPT_AT = 3
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B); the reduced form keeps its vocabulary and heads
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN_REDUCED = dict(QWEN_05B, hidden_size=224, num_hidden_layers=2, intermediate_size=1216)


@dataclass
class Args:
    cpu: bool = False
    """run the reduced form on CPUs even where a GPU is available"""
    workdir: str | None = None
    """folder for the models, runs/ (emptied first) and the logs (default: a temporary folder, removed after a pass)"""
    keep: bool = False
    """keep the temporary folder after a pass (a failed check always keeps it, with the logs)"""
    jobs: int | None = None
    """script runs at a time (default: 4 on a GPU, 2 on CPUs); the speed step always runs alone"""
    timeout: int | None = None
    """seconds one command may take before it is ended and counts as failed (default: 240 on a GPU, 900 on CPUs)"""


@dataclass
class Form:
    device_flag: str
    updates: int
    speed_shape: dict
    speed_name: str
    speed_batch: tuple[int, int, int]  # prompts, samples per prompt, new tokens
    speed_updates: int

    def speed_flags(self) -> list[str]:
        prompts, group, new_tokens = self.speed_batch
        return [
            *("--prompts-per-batch", str(prompts), "--group-size", str(group), "--max-new-tokens", str(new_tokens)),
            *("--total-updates", str(self.speed_updates), "--eval-every", "0"),
        ]


GPU_FORM = Form(
    device_flag="--cuda",
    updates=4,
    speed_shape=QWEN_05B,
    speed_name="Qwen2.5-0.5B shape",
    speed_batch=(8, 8, 64),
    speed_updates=3,
)
CPU_FORM = Form(
    device_flag="--no-cuda",
    updates=3,
    speed_shape=QWEN_REDUCED,
    speed_name="2-layer Qwen2 (hidden 224)",
    speed_batch=(2, 2, 8),
    speed_updates=2,
)


class CheckFailed(Exception):
    pass


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group of ``proc`` (started in a session of its own: torchrun's workers
    too) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class Runner:
    """Runs commands from ``workdir`` (so runs/ lands there), each logged to logs/<name>.log."""

    def __init__(self, workdir: Path, threads: int, timeout: int):
        self.workdir, self.timeout = workdir, timeout
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.env.setdefault("OMP_NUM_THREADS", str(threads))
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()  # commands running now
        self.stopped = False

    def run(self, name: str, argv: list[str], expect_rc: int = 0) -> str:
        """Run ``argv``; its output (stdout and stderr, also in logs/<name>.log) if it exits with ``expect_rc``, else
        CheckFailed with the end of it. The command runs in a process group of its own, which a timeout or a Ctrl-C
        ends whole (torchrun's workers too)."""
        log = self.logs / f"{name}.log"
        with open(log, "w") as f:
            f.write("$ " + " ".join(argv) + "\n")
            f.flush()
            with self.lock:
                if self.stopped:
                    raise CheckFailed(f"{name}: not started (stopped)")
                proc = subprocess.Popen(
                    argv, cwd=self.workdir, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
                self.live.add(proc)
            timed_out = False
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(proc)
            except BaseException:  # Ctrl-C while this (the main) thread waits
                kill_group(proc)
                raise
            finally:
                with self.lock:
                    self.live.discard(proc)
        output = log.read_text(errors="replace")
        tail = "\n".join(output.splitlines()[-25:])
        if timed_out:
            raise CheckFailed(f"{name}: no exit after {self.timeout} s, so ended (log: {log})\n{tail}")
        if proc.returncode != expect_rc:
            raise CheckFailed(f"{name}: exit {proc.returncode}, expected {expect_rc} (log: {log})\n{tail}")
        return output

    def stop(self) -> None:
        """End every running command and start no more (Ctrl-C)."""
        with self.lock:
            self.stopped = True
            live = list(self.live)
        for proc in live:
            kill_group(proc)

    def script(self, name: str, script: str, *flags: str, expect_rc: int = 0) -> str:
        return self.run(name, [sys.executable, str(ROOT / "algorithms" / script), *flags], expect_rc)

    def torchrun(self, name: str, script: str, *flags: str) -> str:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        return self.run(name, [*argv, str(ROOT / "algorithms" / script), *flags])

    def metrics(self, run_name: str) -> list[dict]:
        path = self.workdir / "runs" / run_name / "metrics.jsonl"
        if not path.is_file():
            raise CheckFailed(f"{path} is missing")
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]


def train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "losses/grad_norm" in r]


def check_run(stdout: str, rows: list[dict], updates: int, device: str) -> str:
    """A finished run of ``updates`` updates on ``device``: one training row per update, every logged number finite.
    Returns a short description."""
    if f"1 trainer rank(s) on {device}" not in stdout:
        line = next((s for s in stdout.splitlines() if "trainer rank(s) on" in s), "no such line")
        raise CheckFailed(f"expected the trainer on {device}: {line.strip()[-120:]}")
    if f"done: {updates} updates" not in stdout:
        raise CheckFailed(f"no 'done: {updates} updates' line")
    steps = [r["global_step"] for r in train_rows(rows)]
    if steps != list(range(1, updates + 1)):
        raise CheckFailed(f"training rows for updates {steps}, expected 1..{updates}")
    bad = [
        f"{k}={v} (update {r.get('global_step')})"
        for r in rows
        for k, v in r.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v)
    ]
    if bad:
        raise CheckFailed("non-finite metrics: " + ", ".join(bad[:5]))
    return f"{len(rows)} rows, {sum(len(r) for r in rows)} values finite"


def is_timing(key: str) -> bool:
    return key.startswith("time/") or key.endswith("tokens_per_sec") or key == "async/queue_size"


def comparable(rows: list[dict]) -> list[dict]:
    """The rows without timings (as tests/conftest.py compares runs)."""
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


def same_run(a: list[dict], b: list[dict], rel: float = 1e-5, abs_: float = 1e-6) -> float:
    """CheckFailed unless ``a`` and ``b`` are the same run (tests/conftest.py's assert_same_run: the same steps and
    keys, floats within rel 1e-5 / abs 1e-6); returns the largest absolute difference."""
    a, b = comparable(a), comparable(b)
    if len(a) != len(b):
        raise CheckFailed(f"{len(a)} rows against {len(b)}")
    largest = 0.0
    for ra, rb in zip(a, b):
        if ra.keys() != rb.keys():
            raise CheckFailed(f"update {ra.get('global_step')}: keys differ: {sorted(ra.keys() ^ rb.keys())}")
        for k, va in ra.items():
            vb = rb[k]
            if isinstance(va, float) or isinstance(vb, float):
                if not math.isclose(va, vb, rel_tol=rel, abs_tol=abs_):
                    raise CheckFailed(f"update {ra['global_step']}: {k} {va!r} against {vb!r}")
                largest = max(largest, abs(va - vb))
            elif va != vb:
                raise CheckFailed(f"update {ra['global_step']}: {k} {va!r} against {vb!r}")
    return largest


# ---------------------------------------------------------------- models


def load_toy():
    """reproduce/toy/make_toy_policy.py as a module: its character tokenizer, config and supervised step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_toy_policy", ROOT / "reproduce" / "toy" / "make_toy_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny_policy(out: Path) -> str:
    """A 2-layer Llama (hidden 64) with the toy policy's character tokenizer, warm-started for 100 supervised steps
    on 1-digit sums so that rewards vary within groups (the RL steps then have real gradients)."""
    from common.tasks import make_task

    toy = load_toy()
    tok = toy.build_tokenizer()
    shape = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    config = toy.build_config(tok, **shape, max_position_embeddings=128)
    model = toy.build_model(config, seed=1)
    task = make_task("arithmetic", digits=1, eval_size=8, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(100):
        loss = toy.supervised_step(model, optimizer, toy.supervised_batch(task, tok, task.train_rows(step, 32)))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return f"{sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, warm-start loss {loss:.2f}"


def build_speed_model(out: Path, shape: dict, device: str) -> str:
    """A randomly initialised Qwen2 of ``shape`` in bf16 (as Qwen2.5 ships) with the toy policy's character tokenizer
    (the vocabulary covers it; the model's cost per token does not depend on the tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = load_toy().build_tokenizer()
    assert len(tok) <= shape["vocab_size"]
    config = Qwen2Config(
        **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return f"{n / 1e6:.0f}M parameters"


# ---------------------------------------------------------------- the checks


def main(args: Args) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they come, also into a pipe or a log
    gpu = torch.cuda.is_available() and not args.cpu
    form = GPU_FORM if gpu else CPU_FORM
    device = "cuda" if gpu else "cpu"
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the models' "Writing model shards" bars
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}"
    if gpu:
        print(f"[gpu-check] GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible); {versions}")
    elif args.cpu:
        print(f"[gpu-check] --cpu: the reduced form on CPUs; {versions}")
    else:
        why = "torch.cuda.is_available() is False" + ("" if torch.version.cuda else " (a CPU-only torch build)")
        print(f"[gpu-check] NO GPU: {why}. This runs the reduced form on CPUs; it does not check the GPU paths.")
        print(f"[gpu-check] {versions}")
    jobs = args.jobs or (4 if gpu else 2)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="asyncrl-gpu-check-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(workdir / "runs", ignore_errors=True)  # an earlier pass's runs: the scripts refuse to overwrite them
    runner = Runner(workdir, threads, args.timeout or (240 if gpu else 900))
    print(f"[gpu-check] working in {workdir}; {jobs} runs at a time; OMP_NUM_THREADS={runner.env['OMP_NUM_THREADS']}")
    results: list[tuple[str, bool, float, str]] = []
    t_start = time.perf_counter()

    def record(name: str, fn):
        t0 = time.perf_counter()
        try:
            detail, ok = fn(), True
        except CheckFailed as e:
            detail, ok = str(e), False
        except Exception as e:  # a bug in a check is a failed check, with its message
            detail, ok = f"{type(e).__name__}: {e}", False
        seconds = time.perf_counter() - t0
        with runner.lock:
            results.append((name, ok, seconds, detail))
            if runner.stopped:  # Ctrl-C: the checks it cut short say nothing
                return ok
            print(f"[gpu-check] {'ok  ' if ok else 'FAIL'} {name} ({seconds:.1f} s): {detail.splitlines()[0]}")
            for line in detail.splitlines()[1:] if not ok else []:
                print("    " + line)
            sys.stdout.flush()
        return ok

    tiny = workdir / "models" / "tiny"
    if not record("build the tiny policy", lambda: build_tiny_policy(tiny)):
        return 1
    common = ["--model", str(tiny), form.device_flag, *TINY]
    updates = ["--total-updates", str(form.updates)]

    def script_check(script: str):
        def check():
            name = script[: -len(".py")]
            stdout = runner.script(name, script, *common, *SCRIPTS[script], *updates, "--run-name", name)
            rows = runner.metrics(name)
            detail = check_run(stdout, rows, form.updates, device)
            if "--staleness" in SCRIPTS[script]:
                stale = max(r["async/staleness_max"] for r in train_rows(rows))
                if stale < 1:
                    raise CheckFailed(f"--staleness 2 but async/staleness_max stayed {stale}")
                detail += f"; staleness up to {stale:g}"
            return detail

        return check

    done_grpo = threading.Event()

    def torchrun_check():
        stdout = runner.torchrun("torchrun", "grpo.py", *common, *updates, "--run-name", "torchrun")
        rows = runner.metrics("torchrun")
        detail = check_run(stdout, rows, form.updates, device)
        done_grpo.wait()
        if not (workdir / "runs" / "grpo" / "metrics.jsonl").is_file():
            raise CheckFailed(f"{detail}; no plain grpo.py run to compare with")
        diff = same_run(runner.metrics("grpo"), rows)
        backend = "nccl" if gpu else "gloo"
        return f"{detail}; the plain run's metrics (max diff {diff:.1e}); a world of 1: no {backend} group"

    def resume_check():
        flags = [*common, *RESUME]
        runner.script("resume_full", "grpo.py", *flags, "--run-name", "full")
        stdout = runner.script(
            "resume_part",
            "grpo.py",
            *flags,
            "--debug-interrupt-at",
            str(INTERRUPT_AT),
            "--run-name",
            "part",
            expect_rc=130,
        )
        if f"interrupted at update {INTERRUPT_AT}" not in stdout:
            raise CheckFailed(f"no 'interrupted at update {INTERRUPT_AT}' line")
        if not (workdir / "runs" / "part" / "checkpoint.pt").is_file():
            raise CheckFailed("the interrupted run left no checkpoint.pt")
        stdout = runner.script("resume_rest", "grpo.py", "--resume", str(workdir / "runs" / "part"))
        full, resumed = runner.metrics("full"), runner.metrics("part")
        check_run(stdout, full, 6, device)
        diff = same_run(full, resumed)
        if not any(r["losses/grad_norm"] > 0 for r in train_rows(full)):
            raise CheckFailed("every grad_norm is 0: the comparison would be trivial")
        return f"interrupted after {INTERRUPT_AT} of 6, resumed: the uninterrupted run's metrics (max diff {diff:.1e})"

    speed_model = workdir / "models" / "speed"
    speed: list[dict] = []

    def speed_check():
        flags = ["--model", str(speed_model), form.device_flag, *form.speed_flags()]
        stdout = runner.script("speed", "grpo.py", *flags, "--run-name", "speed")
        rows = runner.metrics("speed")
        detail = check_run(stdout, rows, form.speed_updates, device)
        speed.extend(train_rows(rows))
        return detail

    try:
        with ThreadPoolExecutor(jobs) as pool:
            try:
                pending = [pool.submit(record, "interrupt + resume = uninterrupted (grpo.py)", resume_check)]
                for script in SCRIPTS:

                    def one(script=script):
                        try:
                            return record(f"{script} {form.device_flag}", script_check(script))
                        finally:
                            if script == "grpo.py":
                                done_grpo.set()

                    pending.append(pool.submit(one))
                pending.append(pool.submit(record, "torchrun --nproc-per-node 1 grpo.py", torchrun_check))
                for p in pending:
                    p.result()
            except KeyboardInterrupt:
                runner.stop()  # before the pool waits for its threads
                raise
        # the speed step, alone on the machine
        name = f"build a random {form.speed_name}"
        if record(name, lambda: build_speed_model(speed_model, form.speed_shape, device)):
            record(f"speed: grpo.py on the {form.speed_name}", speed_check)
    except KeyboardInterrupt:
        runner.stop()
        print(f"\n[gpu-check] interrupted; what ran is in {workdir}", flush=True)
        return 130
    total = time.perf_counter() - t_start

    print("\n" + "-" * 120)
    width = max(len(r[0]) for r in results)
    print(f"{'check':<{width}}  result  seconds  detail")
    for name, ok, seconds, detail in results:
        print(f"{name:<{width}}  {'ok' if ok else 'FAIL':<6}  {seconds:7.1f}  {detail.splitlines()[0][:100]}")
    print(f"{'total':<{width}}  {'':<6}  {total:7.1f}")
    if speed:
        prompts, group, new_tokens = form.speed_batch
        batch = f"{prompts} prompts x {group} samples x {new_tokens} new tokens (EOS is rare under random weights)"
        where = torch.cuda.get_device_name(0) if gpu else f"CPUs ({os.cpu_count()} cores)"
        print(f"\nspeed of grpo.py on a random {form.speed_name}, bf16 autocast trainer, bf16 HF engine, {where}:")
        print(f"{batch}")
        print("update  trainer tokens/s  generated tokens/s")
        for r in speed:
            train, gen = r["charts/train_tokens_per_sec"], r["charts/gen_tokens_per_sec"]
            print(f"{r['global_step']:>6}  {train:>16.1f}  {gen:>18.1f}")
        if len(speed) > 1:
            later = speed[1:]  # the first update includes warm-up
            train = sum(r["charts/train_tokens_per_sec"] for r in later) / len(later)
            gen = sum(r["charts/gen_tokens_per_sec"] for r in later) / len(later)
            which = f"updates 2-{len(speed)}" if len(later) > 1 else "update 2"
            print(f"{which}: trainer {train:.1f} tokens/s, generated {gen:.1f} tokens/s")
    failed = [name for name, ok, _, _ in results if not ok]
    form_name = "the GPU form" if gpu else "the reduced form on CPUs, which does not check the GPU paths"
    if failed:
        print(f"\n[gpu-check] {len(failed)} of {len(results)} checks FAILED: {form_name}; logs in {workdir / 'logs'}")
        return 1
    print(f"\n[gpu-check] all {len(results)} checks passed in {total:.0f} s: {form_name}")
    if not args.workdir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
