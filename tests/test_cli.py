"""common/cli.py: grouped --help over a flat Args dataclass, parsing exactly as tyro.cli on the flat class; the checks
of the shared settings."""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import pytest
import tyro

from common.cli import RANGES, check_ranges, check_shared_args, parse
from conftest import ROOT

pytestmark = pytest.mark.unit

DESCRIPTION = "Toy GRPO: the first paragraph of the script's docstring."


@dataclass
class Args:
    """A flat dataclass with the variety of field types of algorithms/grpo.py's Args."""

    exp_name: str = "toy"
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""

    # --- Run and logging
    run_name: str | None = None
    """run folder name under runs/ (default: <task>__<exp_name>__<seed>__<unix time>)"""
    cuda: bool = True
    """train on CUDA when available"""
    chat_template: bool | None = None
    """wrap prompts in the chat template (default: as the prompt template prescribes)"""

    # --- Rollouts and optimisation
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine"""
    total_updates: int | None = None
    """optimizer updates to train for (default: 40; with --staleness s, the FIFO warm-up, about s updates, then 40
    at the full lag)"""
    learning_rate: float = 3e-6
    """AdamW learning rate"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """loss aggregation over tokens"""

    # --- hidden: test hooks
    debug_interrupt_at: int = -1
    """fault injection for tests: behave as if Ctrl-C arrived right after this update"""
    debug_nonfinite_at: tuple[int, ...] = ()
    """fault injection for tests: these updates get a NaN gradient"""

    # --- derived: filled in at runtime
    batch_size: int = 0
    """samples per rollout batch"""
    minibatch_size: int = 0
    """samples per optimizer update"""


def outcome(fn, argv, capsys):
    """(the parsed value or the exit code, what was printed) of ``fn(argv)``."""
    try:
        value = fn(argv)
    except SystemExit as e:
        value = ("exit", e.code)
    out = capsys.readouterr()
    return value, out.out + out.err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--seed", "7", "--exp-name", "x", "--run-name", "r"],
        ["--no-cuda", "--chat-template", "True", "--run-name", "None"],
        ["--cuda", "--chat-template", "None", "--total-updates", "12", "--learning-rate", "1e-4"],
        ["--engine", "vllm", "--loss-agg", "seq-mean-token-mean", "--total-updates", "None"],
        ["--debug-nonfinite-at", "1", "2", "--debug-interrupt-at", "3"],
        ["--learning-rate=2e-5", "--debug-nonfinite-at"],
    ],
)
def test_same_values_as_tyro(argv, capsys):
    assert parse(Args, DESCRIPTION, argv) == tyro.cli(Args, args=argv)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--seed", "x"],
        ["--engine", "tpu"],
        ["--learning-rate"],
        ["--lerning-rate", "3"],
        ["--cuda", "1"],
        ["--chat-template", "maybe"],
        ["--debug-nonfinite-at", "a"],
        ["--debug-interupt-at", "3"],
        ["positional"],
    ],
)
def test_same_errors_as_tyro(argv, capsys):
    ours = outcome(lambda a: parse(Args, DESCRIPTION, a), argv, capsys)
    expected = outcome(lambda a: tyro.cli(Args, args=a), argv, capsys)
    assert expected[0] == ("exit", 2)
    assert ours == expected


def test_empty_argv_gives_the_defaults():
    assert parse(Args, DESCRIPTION, []) == Args()


def test_help_shows_description_groups_and_each_default_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    value, text = outcome(lambda a: parse(Args, DESCRIPTION, a), ["--help"], capsys)
    assert value == ("exit", 0)
    assert DESCRIPTION in text
    assert text.index("--seed") < text.index("Run and logging") < text.index("--run-name")
    assert text.index("--cuda") < text.index("Rollouts and optimisation") < text.index("--engine")
    for hidden in ("debug", "test hooks", "batch-size", "minibatch", "derived"):
        assert hidden not in text
    shown = ["exp-name", "seed", "run-name", "cuda", "chat-template", "engine", "total-updates", "learning-rate"]
    assert text.count("(default:") == len(shown + ["loss-agg"])
    assert text.count("(default: <task>__") == text.count("(default: as the prompt") == 1
    assert "(default: 40;" in text and "(default: None)" not in text


def test_test_hooks_stay_settable():
    args = parse(Args, DESCRIPTION, ["--debug-nonfinite-at", "1", "2", "--debug-interrupt-at", "5"])
    assert (args.debug_nonfinite_at, args.debug_interrupt_at) == ((1, 2), 5)


@pytest.mark.parametrize("flag", ["--batch-size", "--minibatch-size"])
def test_derived_fields_are_not_settable(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(Args, DESCRIPTION, [flag, "4"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


# ------------------------------------------------------------------ check_shared_args
def shared(**changes) -> SimpleNamespace:
    """The shared settings check_shared_args reads, at grpo.py's defaults unless changed."""
    values = dict(
        staleness=0,
        checkpoint_minutes=30.0,
        prompts_per_batch=16,
        group_size=8,
        updates_per_batch=4,
        total_updates=40,
        max_new_tokens=16,
        micro_batch_size=16,
        eval_batch_size=64,
        batch_size=0,
        minibatch_size=0,
    )
    return SimpleNamespace(**{**values, **changes})


def test_check_shared_args_fills_the_batch_arithmetic():
    args = shared()
    check_shared_args(args, world=1)
    assert (args.batch_size, args.minibatch_size) == (128, 32)
    args = shared(micro_batch_size=8)  # 32 samples in 4 micro-batches, 2 per rank
    check_shared_args(args, world=2)
    assert (args.batch_size, args.minibatch_size) == (128, 32)


@pytest.mark.parametrize(
    "changes,world,message",
    [
        ({"staleness": -1}, 1, r"--staleness must be >= 0 \(updates of lag\), got -1"),
        ({"checkpoint_minutes": -0.5}, 1, r"--checkpoint-minutes must be >= 0 .*got -0.5"),
        ({"total_updates": 0}, 1, r"--total-updates must be >= 1, got 0"),
        ({"micro_batch_size": 0}, 1, r"--micro-batch-size must be >= 1, got 0"),
        ({"eval_batch_size": 0}, 1, r"--eval-batch-size must be >= 1, got 0"),
        ({"updates_per_batch": 3}, 1, r"= 128 cannot be split into --updates-per-batch 3 .*a divisor of 128"),
        # 32 samples in micro-batches of 16: 2 micro-batches cannot go to 3 ranks
        ({}, 3, r"makes 2 micro-batches of --micro-batch-size 16, .*3 trainer ranks: .*ceil\(32 / M\) a multiple"),
        ({"micro_batch_size": 12}, 2, r"makes 3 micro-batches"),  # ceil(32 / 12) = 3
    ],
)
def test_check_shared_args_says_what_to_change(changes, world, message):
    with pytest.raises(SystemExit, match=message):
        check_shared_args(shared(**changes), world)


@pytest.mark.parametrize(
    "flag,bad,good",
    [
        ("temperature", [0.0, -1.0], [0.7, 1.0]),
        ("top_p", [0.0, 1.5, -0.1], [0.9, 1.0]),
        ("learning_rate", [0.0, -1e-5], [3e-6]),
        ("eval_every", [-1], [0, 10]),
        ("checkpoint_every", [-1], [0, 5]),
        ("eval_size", [-5], [0, 200]),
        ("kl_coef", [-1.0], [0.0, 0.04]),
        ("clip_eps", [-0.1, 1.0], [0.0, 0.2]),
        ("clip_eps_low", [-0.1, 1.5], [0.2]),
        ("clip_eps_high", [-0.1], [0.0, 0.28]),
        ("max_grad_norm", [0.0], [1.0]),
        ("warmup_updates", [-1], [0, 20]),
        ("max_new_tokens", [0], [1]),
        ("delta_tv", [0.0, -0.1], [0.15, 1.0]),
        ("delta_kl", [0.0, -0.05], [0.05]),
        ("ratio_cap", [0.0, -1.0], [None, 20.0]),
    ],
)
def test_check_ranges_refuses_impossible_values_of_the_flags_a_script_has(flag, bad, good):
    for value in bad:
        with pytest.raises(SystemExit, match=rf"^--{flag.replace('_', '-')} must be .*, got {value}$"):
            check_ranges(SimpleNamespace(**{flag: value}))
    for value in good:
        check_ranges(SimpleNamespace(**{flag: value}))
    check_ranges(SimpleNamespace())  # a script without the flag: nothing to check
    assert flag in RANGES


def test_every_range_names_a_flag_of_some_script():
    scripts = " ".join(p.read_text() for p in (ROOT / "algorithms").glob("*.py"))
    assert all(f"\n    {name}: " in scripts for name in RANGES), [n for n in RANGES if f"\n    {n}: " not in scripts]
