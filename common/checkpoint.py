"""Checkpoints: one torch file per save, written atomically (a crash never leaves half a file), the run folder that
holds them (made, locked and checked before a run builds anything), and the guard that keeps a non-finite loss or
gradient out of the weights."""

import atexit
import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from common.distributed import broadcast


def rng_state() -> dict:
    """Python, numpy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """torch.save ``state`` to ``path`` via a temporary file and an atomic rename. A failed write (disk full, no
    permission) removes the temporary file, leaves an earlier checkpoint at ``path`` as it was, and ends the run
    with a SystemExit that says so."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a failed open or write as a RuntimeError
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        kept = f"the previous checkpoint {path} is intact" if path.is_file() else f"no earlier checkpoint is at {path}"
        raise SystemExit(
            f"could not write the checkpoint {path}: {e}\n{kept}. Free disk space or make the folder "
            f"writable; --resume continues from the last checkpoint written."
        ) from e
    return path


def save_model(model, tokenizer, state_dict: dict, out_dir: str | Path) -> Path:
    """Write the trained policy as a Hugging Face folder: ``state_dict`` (full, unsharded: full_model_state) as
    model.safetensors with ``model``'s config and generation config, and ``tokenizer``'s files with its chat template,
    so from_pretrained, the scripts' --model, reproduce/eval/evaluate.py and vLLM load it. Written to a temporary
    folder first and renamed: a crash leaves the earlier folder or the new one."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        # save_pretrained records the class's name; under FSDP2 that is its wrapper (FSDPLlamaForCausalLM)
        config = json.loads((tmp / "config.json").read_text())
        config["architectures"] = [
            next(c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers."))
        ]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"could not write the trained model to {out}: {e}. Free disk space or make the folder writable."
        ) from e
    return out


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint ``path`` (a checkpoint.pt or its run folder) as a dict; a missing, empty, truncated or foreign
    file is a SystemExit that says so, before the run builds anything."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise SystemExit(f"--resume {path}: no checkpoint there; pass a checkpoint.pt or its run folder.")
    try:  # memory-mapped: a trainer rank that needs only the settings and counters does not read the tensors
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # empty or cut short (a full disk, a copy that stopped): torch says it in its own words
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(
            f"--resume {path}: not a readable checkpoint ({path.stat().st_size} bytes; {why}); resume from a "
            f"complete copy of it."
        ) from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("args"), dict) and "update" in ckpt):
        raise SystemExit(f"--resume {path}: not a checkpoint of these scripts (no run settings and update in it).")
    return ckpt


# flags a resumed run takes from its command line: how long it runs and when it gives up, when it saves and
# evaluates, where it logs. None changes what the remaining updates compute (--total-updates adds updates;
# --max-sampling-rounds, dapo's, lets a run that stopped for it go on); the hidden --debug-* test hooks are applied too
RESUME_FLAGS = (
    "total_updates",
    "max_sampling_rounds",
    "max_nonfinite_skips",
    "checkpoint_every",
    "checkpoint_minutes",
    "keep_final_state",
    "eval_every",
    "eval_batch_size",
    "track",
    "wandb_project",
    "dist_timeout_minutes",
)


def given_flags(args, argv: list[str]) -> list[str]:
    """The fields of ``args`` that ``argv`` sets, in order (``--total-updates 5``, ``--total-updates=5``,
    ``--no-track``, ``--debug-nonfinite-at 1 2``: total_updates, total_updates, track, debug_nonfinite_at)."""
    names = []
    for a in argv:
        if not a.startswith("--"):
            continue
        name = a[2:].split("=")[0].replace("-", "_")
        if not hasattr(args, name) and name.startswith("no_"):
            name = name[3:]
        if hasattr(args, name) and name not in names:
            names.append(name)
    return names


def resumed_args(args, ckpt: dict, argv: list[str] | None = None):
    """The settings of a resumed run: the checkpoint's, except ``--resume`` and the RESUME_FLAGS and ``--debug-*``
    test hooks given on the command line (``argv``, default ``sys.argv[1:]``). Any other flag given with a value
    that differs from the checkpoint's is a SystemExit naming them (a resumed run is the run that wrote the
    checkpoint; a change is a new run), and so is a ``--total-updates`` at or below the checkpoint's update.
    ``args`` is the parsed command line (an instance of the script's Args)."""
    argv, saved = sys.argv[1:] if argv is None else argv, ckpt["args"]
    foreign = sorted(set(saved) - set(vars(args)))
    if foreign:  # another script's settings (dapo.py's overlong_buffer, m2po.py's tau, ...)
        raise SystemExit(
            f"--resume {args.resume}: written by {saved.get('exp_name', 'another script')}.py, whose settings "
            f"({', '.join(foreign[:3])}) {getattr(args, 'exp_name', 'this script')}.py does not have; resume it with "
            f"the script that wrote it."
        )
    resumed = type(args)(**saved)
    resumed.resume = args.resume
    changed = []
    for name in given_flags(args, argv):
        if name in RESUME_FLAGS or name.startswith("debug_"):
            setattr(resumed, name, getattr(args, name))
        elif name != "resume" and getattr(args, name) != saved.get(name):
            changed.append(f"--{name.replace('_', '-')} {getattr(args, name)} (the checkpoint's: {saved.get(name)})")
    if changed:
        allowed = ", ".join(f"--{n.replace('_', '-')}" for n in RESUME_FLAGS if hasattr(args, n))
        raise SystemExit(
            f"--resume: {'; '.join(changed)}: a resumed run keeps its checkpoint's settings; start a new run to "
            f"change them (a resume may change only {allowed})"
        )
    if resumed.total_updates <= ckpt["update"]:
        raise SystemExit(
            f"--resume: the checkpoint is at update {ckpt['update']}; pass --total-updates N with "
            f"N > {ckpt['update']} to train further"
        )
    return resumed


RUN_FILES = ("metrics.jsonl", "model", "checkpoint.pt")  # what a run leaves in its folder once it has logged
LOCK = ".lock"  # in the run folder, flock()ed by the process that runs in it, with its process id


def run_folder(args, rank: int, ckpt: dict | None = None) -> str:
    """The run's folder: runs/<--run-name> for a new run (default <task>__<exp_name>__<seed>__<unix time>, rank 0's
    clock), or for --resume the folder holding the checkpoint, whose name becomes the run name (``args.run_name``)
    wherever it was moved. Rank 0 makes and locks it (lock_run_folder) and says where a resumed run (``ckpt``)
    continues. Returns the folder's path."""
    if args.resume:
        folder = Path(args.resume) if Path(args.resume).is_dir() else Path(args.resume).parent
        args.run_name = folder.resolve().name
    else:
        args.run_name = broadcast(args.run_name or f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}")
        folder = Path("runs") / args.run_name
    if rank == 0:
        lock_run_folder(folder, new=not args.resume)
        if ckpt is not None:
            print(f"resumed at update {ckpt['update']}: the run continues in {folder}", flush=True)
    return str(folder)


@contextlib.contextmanager
def signals_held(sigs=(signal.SIGINT, signal.SIGTERM)):
    """Hold Ctrl-C and SIGTERM while the block runs and deliver each one that came (once) when it ends, so that a
    block that makes something and registers its clean-up is never cut between the two. Only the main thread sets
    signal handlers: in another thread, and for a signal whose handler Python did not set, the block runs as is."""
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in sigs if main and signal.getsignal(sig) is not None}
    came = []
    for sig in before:
        signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(came):
            signal.raise_signal(sig)


def lock_run_folder(folder: str | Path, new: bool = True):
    """Make ``folder`` and hold it for the life of this process: an exclusive flock() on its .lock file, which the
    kernel drops when the process ends, however it ends, so a killed run never leaves it stuck. Refused with a
    SystemExit that says what to change: a folder that another live process holds (two runs would tear each other's
    metrics lines), for a ``new`` run a folder that already holds a run (metrics, a trained model or a checkpoint:
    its files would be overwritten), and a folder that cannot be made (a read-only working folder). At exit the lock
    file goes, and so do the folder and its parent when this call made them and they are left empty (a run stopped
    by bad input leaves nothing). Returns that release function (atexit calls it too; once is enough)."""
    folder = Path(folder)
    with signals_held():  # the folder, its lock and their clean-up at exit: made as one step
        made = [d for d in (folder, *folder.parents) if not d.exists()]  # deepest first
        for _ in range(3):  # again if the lock file was removed between open() and flock() by a run that just ended
            try:
                folder.mkdir(parents=True, exist_ok=True)
                f = open(folder / LOCK, "a+")
            except OSError as e:
                raise SystemExit(
                    f"cannot make the run folder {folder} ({e.strerror or e}): run from a folder you can write to."
                ) from None
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                pid = f.read().strip() or "?"
                f.close()
                raise SystemExit(
                    f"{folder} is in use by another run (process {pid}); "
                    "pick another --run-name, or wait for it to end."
                ) from None
            try:
                held, named = os.fstat(f.fileno()), os.stat(folder / LOCK)
                if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                    break
            except FileNotFoundError:
                pass
            f.close()
        else:
            raise SystemExit(f"{folder}: could not lock its {LOCK} file; another run keeps starting and ending there.")
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        owner = os.getpid()

        def release():
            if f.closed or os.getpid() != owner:  # a forked child (an engine's worker) leaves the run's lock alone
                return
            (folder / LOCK).unlink(missing_ok=True)  # before the lock goes: a run starting now makes a new file
            f.close()
            for d in made:  # the folder, then runs/, when this call made them and nothing is in them
                try:
                    d.rmdir()
                except OSError:
                    break

        atexit.register(release)
    found = [n for n in RUN_FILES if (folder / n).exists() and (n != "metrics.jsonl" or (folder / n).stat().st_size)]
    if new and found:
        release()
        again = f", or continue it with --resume {folder}" if "checkpoint.pt" in found else ""
        raise SystemExit(f"{folder} already holds a run ({', '.join(found)}): pick another --run-name{again}.")
    return release


def resume_needs_current_weights(ckpt: dict, needed: dict[int, int]) -> bool:
    """Check that a checkpoint kept the engine weights its resumed run needs.

    ``needed`` maps each rollout batch still to be generated to the policy version that generates it. A run keeps
    only the weights its own plan needs (the engine's current version and the payloads queued for it), so a resume
    that extends the run (a larger --total-updates) may need an older version it dropped: that ends the run with a
    SystemExit saying what to do. Returns True when some batch is generated by the checkpoint's own version and no
    payload of it was kept (the run being extended ended there): the caller then hands the engine the current
    weights.
    """
    held = {v for v, _ in ckpt["pending_weights"]} | {ckpt["engine_version"]}
    missing = [k for k, v in sorted(needed.items()) if v < ckpt["update"] and v not in held]
    if missing:
        raise SystemExit(
            f"--resume: batch {missing[0]} must be generated by version {needed[missing[0]]}, whose weights the run "
            f"that wrote this checkpoint did not keep (it was planned for {ckpt['args']['total_updates']} updates); "
            f"resume with --total-updates <= that, or plan the longer run from the start"
        )
    return ckpt["update"] in needed.values() and ckpt["update"] not in held


class NonFiniteGuard:
    """Keeps NaN/inf out of the weights: ``check(update, name=value, ...)`` is False when any value (a loss, a
    gradient norm) is not finite; the caller then skips that optimizer step, so weights and optimizer state stay
    as they were. Counts the skips (``skips``, over the run; ``streak``, in a row), says each one on the console
    through ``log``, and ``exhausted`` turns True after ``max_streak`` skips in a row (0: never)."""

    def __init__(self, max_streak: int, skips: int = 0, log=print):
        if max_streak < 0:
            raise SystemExit(f"--max-nonfinite-skips must be >= 0 (0: never stop for them), got {max_streak}")
        self.max_streak, self.skips, self.streak, self.log = max_streak, skips, 0, log

    def check(self, update: int, **values) -> bool:
        bad = {k: float(v) for k, v in values.items() if not math.isfinite(float(v))}
        if not bad:
            self.streak = 0
            return True
        self.skips, self.streak = self.skips + 1, self.streak + 1
        self.log(
            f"update {update}: non-finite {', '.join(f'{k} {v}' for k, v in bad.items())}: optimizer step "
            f"skipped, weights and optimizer state unchanged ({self.streak} in a row, {self.skips} in the run)",
            flush=True,
        )
        return False

    @property
    def exhausted(self) -> bool:
        return self.max_streak > 0 and self.streak >= self.max_streak

    def message(self, update: int, ckpt_path: str | Path) -> str:
        """Why the run stops, for the SystemExit raised after saving the last finite state."""
        return (
            f"updates {update - self.streak + 1}-{update}: {self.streak} in a row had a non-finite loss or "
            f"gradient norm (--max-nonfinite-skips {self.max_streak}); stopped. The weights and optimizer state "
            f"are the last finite ones, saved in {ckpt_path}. Look for the cause (learning rate, bf16 overflow, "
            f"the data) before resuming with --resume."
        )
