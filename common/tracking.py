"""Metrics: runs/<run_name>/metrics.jsonl always, a console line per step, wandb behind --track."""

import json
import math
import os
import time
from pathlib import Path


def format_duration(seconds: float) -> str:
    """12 -> '12s', 75 -> '1m15s', 3700 -> '1h01m'."""
    seconds = int(round(max(0.0, seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def progress_line(
    step: int, total: int, elapsed: float, eta: float, metrics: dict, keys: list[str], width: int = 20
) -> str:
    """'[#####-----] 5/10 12s<12s | reward 0.41 ...': a bar, the step, elapsed<ETA (``eta`` seconds, e.g.
    Tracker.eta; nan shows '?'), chosen metrics."""
    frac = step / total if total else 1.0
    bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            label = k.split("/")[-1] if k.startswith("charts/") else k.replace("/", ".")
            parts.append(f"{label} {v:.4g}" if isinstance(v, float) else f"{label} {v}")
    eta_s = format_duration(eta) if math.isfinite(eta) else "?"
    return f"[{bar}] {step}/{total} {format_duration(elapsed)}<{eta_s} | " + " ".join(parts)


class Tracker:
    """Writes each ``log`` call as one JSON line (with ``global_step`` and ``time/elapsed``, wall-clock seconds since
    the run started, carried on across a resume); mirrors to wandb when enabled. A write that fails (disk full) is
    taken back, so the file holds whole rows, and ends the run with a SystemExit that says so.

    ``resume``: the update a resumed run continues from (its checkpoint's). The file keeps the rows up to it and
    drops later ones (logged by a run killed after that checkpoint, and logged again now): one row per update."""

    def __init__(
        self,
        run_dir: str | Path,
        config: dict,
        track: bool = False,
        project: str = "asyncrl",
        run_name: str | None = None,
        resume: int | None = None,
        enabled: bool = True,
    ):
        self.run_dir, self.enabled = Path(run_dir), enabled
        if not enabled:  # a trainer rank other than 0: logging is rank 0's
            return
        self.path = self.run_dir / "metrics.jsonl"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lines = self.path.read_text().splitlines() if resume is not None and self.path.exists() else []
            kept = [r for r in map(parse_row, lines) if r is not None and r.get("global_step", 0) <= resume]
            if len(kept) < len(lines):  # rewritten atomically: a kill now leaves the old file or the new one
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
            # unbuffered bytes: a row is on disk once log() returns, and a failed write can be taken back (log)
            self.file = open(self.path, "ab" if resume is not None else "wb", buffering=0)
            with open(self.run_dir / "config.json", "w") as f:
                json.dump(config, f, indent=2, default=str)
        except OSError as e:
            raise SystemExit(
                f"could not write to the run folder {run_dir} ({e.strerror or e}): free disk space or make it writable."
            ) from None
        self.offset = max((r.get("time/elapsed", 0.0) for r in kept), default=0.0)  # a resumed run's clock goes on
        self.wandb = None
        if track:
            import wandb  # imported only when asked for

            self.wandb = wandb.init(
                project=project,
                name=run_name or self.run_dir.name,
                config=config,
                dir=str(self.run_dir),
                save_code=True,  # the tracked run keeps the script that produced it
                mode=os.environ.get("WANDB_MODE", "online"),
            )
        self.start = time.time()
        self.last, self.intervals = self.start, []  # (seconds since the previous row, whether it was evaluated)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {
            "global_step": step,
            **{k: (float(v) if hasattr(v, "item") else v) for k, v in metrics.items()},
            "time/elapsed": self.offset + time.time() - self.start,
        }
        data, size = memoryview((json.dumps(row) + "\n").encode()), os.fstat(self.file.fileno()).st_size
        try:
            while data:  # a write may take part of the row (a disk about to fill): the rest follows
                data = data[self.file.write(data) :]
        except OSError as e:  # disk full, quota: the part written goes, so the file stays whole rows
            os.ftruncate(self.file.fileno(), size)
            raise SystemExit(
                f"could not write {self.path} ({e.strerror or e}); it holds every row before update {step}, whole. "
                f"Free disk space; --resume {self.run_dir} continues from the run's last checkpoint, if it wrote one."
            ) from None
        now = time.time()
        self.intervals = (self.intervals + [(now - self.last, "eval/accuracy" in metrics)])[-50:]
        self.last = now
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def eta(self, step: int, total: int, eval_every: int, window: int = 10) -> float:
        """Seconds until update ``total``, from the last ``window`` logged updates without an evaluation (an update's
        own pace, not the start's: engine start, a FIFO warm-up) plus, for each evaluation still to come (every
        ``eval_every`` updates and at the end), what the recent evaluated updates took beyond that pace. nan before
        any update was logged (or on a rank that does not log)."""
        if not self.enabled:
            return float("nan")
        plain = [dt for dt, evaluated in self.intervals[1:] if not evaluated][-window:]  # [0]: since the start
        if not plain:
            return float("nan")
        pace = sum(plain) / len(plain)
        evals = [dt - pace for dt, evaluated in self.intervals[1:] if evaluated][-3:]
        to_come = (total // eval_every - step // eval_every + (total % eval_every != 0)) if eval_every > 0 else 0
        return pace * (total - step) + (max(0.0, sum(evals) / len(evals)) * to_come if evals else 0.0)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def parse_row(line: str) -> dict | None:
    """One metrics.jsonl line as a dict; None for a blank line or one torn by a kill in the middle of a write."""
    try:
        return json.loads(line) if line.strip() else None
    except ValueError:
        return None


def read_metrics(path: str | Path) -> list[dict]:
    """Read a metrics.jsonl file back into a list of dicts."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
