"""Command-line parsing of a script's flat ``Args`` dataclass, with ``--help`` in groups.

Groups are declared in the class body by comment headers: a line ``# --- Title`` starts a group holding every
field after it, up to the next header; fields above the first header are listed ungrouped, at the top. Two title
prefixes set a group apart:

- ``# --- hidden: ...``: the fields stay settable from the command line but are left out of ``--help`` (test hooks);
- ``# --- derived: ...``: the fields are neither settable nor shown and keep their defaults (filled in at runtime).

Flag names, parsed values and errors are those of ``tyro.cli(cls)``; each field's docstring is its help text, and a
docstring that states its own ``(default: ...)`` gets no second one from tyro.
"""

import ast
import atexit
import dataclasses
import inspect
import os
import signal
import sys
import textwrap
import typing
from typing import Annotated

import tyro


def _docs_and_titles(cls) -> dict[str, tuple[str, str | None]]:
    """Each field of ``cls`` (by name) -> (the title of its group, "" above the first header; its docstring), read
    from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = [line.strip() for line in source.splitlines()]
    headers = [(i, line[5:].strip()) for i, line in enumerate(lines, 1) if line.startswith("# ---")]
    body = ast.parse(source).body[0].body
    out = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            doc = after.value.value if is_doc and isinstance(after.value.value, str) else None
            title = ([""] + [t for i, t in headers if i < node.lineno])[-1]
            out[node.target.id] = (title, doc)
    return out


def _field(f: dataclasses.Field, typ, doc: str | None, *markers) -> tuple:
    """A make_dataclass field spec for ``f`` with its docstring as help (one line, as tyro shows docstrings)."""
    help = " ".join(doc.split()) if doc else None
    hint = "" if help and "(default:" in help else None  # the docstring already says it: no "(default: ...)" twice
    typ = Annotated[typ, tyro.conf.arg(help=help, help_behavior_hint=hint), *markers]
    return f.name, typ, dataclasses.field(default=f.default, default_factory=f.default_factory)


def parse(cls, description: str, argv: list[str] | None = None):
    """Parse ``argv`` (default: sys.argv[1:]) into the flat dataclass ``cls`` as ``tyro.cli(cls)`` does, with
    ``--help`` showing ``description`` and the fields in the groups of the class body (module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    asks_help = bool({"-h", "--help"} & set(argv))
    docs, types = _docs_and_titles(cls), typing.get_type_hints(cls, include_extras=True)
    top, groups = [], {}
    for f in (f for f in dataclasses.fields(cls) if f.init):
        title, doc = docs.get(f.name, ("", None))
        hide = title.startswith("derived:") or (asks_help and title.startswith("hidden:"))
        spec = _field(f, types[f.name], doc, *([tyro.conf.Suppress] if hide else []))
        (groups.setdefault(title, []) if title else top).append(spec)
    nested = [
        (
            f"group_{i}",
            Annotated[
                dataclasses.make_dataclass(f"Group{i}", specs), tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=title)
            ],
        )
        for i, (title, specs) in enumerate(groups.items())
    ]
    parsed = tyro.cli(
        dataclasses.make_dataclass(cls.__name__, top + nested, kw_only=True), args=argv, description=description
    )
    values = {name: getattr(parsed, name) for name, *_ in top}
    for name, _ in nested:
        values.update(vars(getattr(parsed, name)))
    return cls(**values)


def quiet_startup_interrupts(every: float = 0.5) -> None:
    """Until the script installs its own handlers (from its training loop on, Ctrl-C and SIGTERM stop the run with a
    checkpoint), Ctrl-C or SIGTERM ends the start-up with one line, on rank 0 (``RANK``), and exit status 130
    instead of a traceback; exit handlers still run (the run folder's lock goes, and an empty run folder with it).
    The SystemExit can be swallowed where the signal lands: by an extension module being imported (numpy.random's
    Cython module does) or, with a traceback, in a weakref callback or ``__del__`` (the import system's module
    locks). So it is raised again every ``every`` seconds (SIGALRM) until the exit handlers start, and a swallowed
    one prints nothing."""

    def stop(signum, frame):
        if signum != signal.SIGALRM:
            if os.environ.get("RANK", "0") == "0":
                print("interrupted during start-up, before any update: nothing to save", file=sys.stderr, flush=True)
            atexit.register(signal.setitimer, signal.ITIMER_REAL, 0)  # registered last, so it runs first
            signal.signal(signal.SIGALRM, stop)
            signal.setitimer(signal.ITIMER_REAL, every, every)
            hook = sys.unraisablehook
            sys.unraisablehook = lambda u: None if isinstance(u.exc_value, SystemExit) else hook(u)
        raise SystemExit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


# flag -> (test, what its value must be), checked by check_ranges wherever a script has the flag
RANGES = {
    **{n: (lambda v: v >= 1, ">= 1") for n in ("prompts_per_batch", "updates_per_batch", "total_updates")},
    **{n: (lambda v: v >= 1, ">= 1") for n in ("max_new_tokens", "micro_batch_size", "eval_batch_size")},
    "checkpoint_minutes": (lambda v: v >= 0, ">= 0 (0: no safety checkpoints)"),
    "checkpoint_every": (lambda v: v >= 0, ">= 0 (0: checkpoints only on Ctrl-C/SIGTERM and by wall-clock)"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0 disables evaluation)"),
    "eval_size": (lambda v: v >= 0, ">= 0 (0: all of a benchmark)"),
    "temperature": (lambda v: v > 0, "> 0 (tokens are sampled from softmax(logits / temperature))"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (the nucleus's probability mass; 1 keeps every token)"),
    "learning_rate": (lambda v: v > 0, "> 0"),
    "max_grad_norm": (lambda v: v > 0, "> 0 (the gradient's norm is clipped to it)"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "warmup_updates": (lambda v: v >= 0, ">= 0 (0: no warm-up)"),
    "kl_coef": (lambda v: v >= 0, ">= 0 (0 disables the KL penalty)"),
    "clip_eps": (lambda v: 0 <= v < 1, "in [0, 1) (the ratio is clipped to [1 - eps, 1 + eps])"),
    "clip_eps_low": (lambda v: 0 <= v < 1, "in [0, 1) (the ratio's lower bound is 1 - it)"),
    "clip_eps_high": (lambda v: v >= 0, ">= 0 (the ratio's upper bound is 1 + it)"),
    "delta_tv": (lambda v: v > 0, "> 0 (the binary TV threshold; DPPO's recipe uses 0.15)"),
    "delta_kl": (lambda v: v > 0, "> 0 (the binary KL threshold; DPPO's recipe uses 0.05)"),
    "ratio_cap": (lambda v: v is None or v > 0, "> 0, or None for no cap"),
}


def check_ranges(args) -> None:
    """Refuse, before anything is built, a value outside RANGES for each flag the script has, with a SystemExit that
    says what the flag must be (a negative temperature or learning rate would otherwise be trained on)."""
    for name, (ok, need) in RANGES.items():
        if hasattr(args, name) and not ok(getattr(args, name)):
            raise SystemExit(f"--{name.replace('_', '-')} must be {need}, got {getattr(args, name)}")


def check_shared_args(args, world: int) -> None:
    """The checks of the settings every script shares (check_ranges among them), each failure a SystemExit that says
    what to change, and the
    batch arithmetic they imply: fills ``args.batch_size`` (prompts x group size) and ``args.minibatch_size`` (the
    samples of one optimizer update). The minibatch is cut into micro-batches of ``--micro-batch-size``, dealt out
    to the ``world`` trainer ranks, so their number must be a multiple of ``world``."""
    if args.staleness < 0:
        raise SystemExit(f"--staleness must be >= 0 (updates of lag), got {args.staleness}")
    check_ranges(args)
    args.batch_size = args.prompts_per_batch * args.group_size
    if args.batch_size % args.updates_per_batch:
        raise SystemExit(
            f"batch of {args.prompts_per_batch} prompts x {args.group_size} samples = {args.batch_size} "
            f"cannot be split into --updates-per-batch {args.updates_per_batch} equal minibatches; "
            f"choose a divisor of {args.batch_size}"
        )
    args.minibatch_size = args.batch_size // args.updates_per_batch
    n_micro = -(-args.minibatch_size // args.micro_batch_size)
    if n_micro % world:
        raise SystemExit(
            f"a minibatch of {args.minibatch_size} samples makes {n_micro} micro-batches of "
            f"--micro-batch-size {args.micro_batch_size}, which cannot be dealt evenly to {world} trainer "
            f"ranks: choose --micro-batch-size M with ceil({args.minibatch_size} / M) a multiple of {world}"
        )
