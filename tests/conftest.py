import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "algorithms"))


@pytest.fixture(scope="session")
def default_tokenizer_path():
    from common.models import resolve_model

    return resolve_model(None)  # converts the embedded model once (cached outside the repo)


def warm_start(model, tok, steps: int = 60):
    """A few supervised steps on 1-digit sums so the random model answers with numbers: rewards then vary
    within groups and the RL tests exercise real gradients (it stays far from accurate)."""
    import random

    from common.logprobs import collate, response_logprobs
    from common.tasks import encode_prompt

    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(16)]
        prompts = [encode_prompt(tok, f"What is {a} + {b}? Reply with just the number.") for a, b in pairs]
        answers = [tok(str(a + b))["input_ids"] + [tok.eos_token_id] for a, b in pairs]
        logp, _ = response_logprobs(model, collate(prompts, answers, tok.pad_token_id), with_grad=False)
        loss = -logp.sum() / sum(len(a) for a in answers)
        opt.zero_grad()
        loss.backward()
        opt.step()


def tiny_llama(tmp_path_factory, tokenizer_path, name: str, **shape) -> str:
    """A randomly initialised 2-layer Llama of ``shape`` with the default model's tokenizer and chat template and
    tied embeddings, warm-started, saved to a fresh folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    warm_start(model, tok)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_tokenizer_path):
    """A randomly initialised 2-layer Llama with the default model's tokenizer and chat template."""
    return tiny_llama(
        tmp_path_factory,
        default_tokenizer_path,
        "tiny-llama",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="session")
def tiny_vllm_model_path(tmp_path_factory, default_tokenizer_path):
    """The tiny Llama with 32-dim heads (vLLM's CPU attention needs head sizes that are multiples of 32)."""
    return tiny_llama(
        tmp_path_factory,
        default_tokenizer_path,
        "tiny-llama-vllm",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def run_script(script: str, *flags: str, cwd, timeout: int = 240, check: bool = True):
    """Run algorithms/<script> in a subprocess from ``cwd`` (so runs/ lands there)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "algorithms" / script), *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return proc


TOY_SCRIPT = "../reproduce/toy/make_toy_policy.py"  # run_script resolves it against algorithms/
TOY_TINY = [
    "--max-steps",
    "3",
    "--check-every",
    "3",
    "--band",
    "0",
    "1",
    "--sampled-band",
    "0",
    "1",
    "--batch-size",
    "8",
    "--hidden-size",
    "64",
    "--num-layers",
    "1",
    "--num-heads",
    "2",
    "--num-kv-heads",
    "1",
    "--intermediate-size",
    "64",
    "--eval-size",
    "8",
    "--eval-max-new-tokens",
    "6",
]


@pytest.fixture(scope="session")
def toy_path(tmp_path_factory):
    """A toy policy built by reproduce/toy/make_toy_policy.py with tiny settings (a few steps: the tests check the
    plumbing, not accuracy)."""
    cwd = tmp_path_factory.mktemp("toy-build")
    out = cwd / "toy"
    proc = run_script(TOY_SCRIPT, "--out", str(out), "--digits", "1", *TOY_TINY, cwd=cwd)
    assert "greedy eval accuracy" in proc.stdout
    return out


def run_torchrun(script: str, *flags: str, cwd, nproc: int = 2, timeout: int = 300, check: bool = True):
    """Run algorithms/<script> (or any path) under ``torchrun --standalone --nproc-per-node nproc`` from ``cwd``:
    ``nproc`` trainer ranks on CPUs (gloo), one thread each."""
    path = script if os.path.isabs(str(script)) else str(ROOT / "algorithms" / script)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), path, *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-5000:]}"
        )
    return proc


# ---------------------------------------------------------------- every script's own copy of a shared helper
def own_copies(name: str, besides: tuple[str, ...] = ()) -> list:
    """Every algorithms/ script's own copy of the module-level function ``name``, as pytest params named after the
    script: each script keeps its own copies of the loss helpers (one file = one algorithm), so a test of a helper
    runs on each copy. ``besides``: scripts whose copy differs on purpose and has its own test there."""
    scripts = [
        p.stem
        for p in sorted((ROOT / "algorithms").glob("*.py"))
        if re.search(rf"^def {name}\(", p.read_text(), re.MULTILINE)
    ]
    assert set(besides) <= set(scripts), f"{besides} do not define {name}: {scripts}"
    return [pytest.param(getattr(importlib.import_module(s), name), id=s) for s in scripts if s not in besides]


# ---------------------------------------------------------------- helpers the run tests share
FAST = [
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


def not_timing(k):
    """a logged value that does not measure time (time/*, *_per_sec, *_time_frac) nor the queue size, which depends
    on it: the values a same-seed run must repeat bit for bit"""
    return not (k.startswith("time/") or k.endswith(("tokens_per_sec", "time_frac")) or k == "async/queue_size")


def metrics_of(cwd, name):
    return read_metrics(cwd / "runs" / name / "metrics.jsonl")


def comparable(rows):
    return [{k: v for k, v in r.items() if not_timing(k)} for r in rows]


def assert_same_run(a, b):
    """Two runs' comparable metrics are the same run, bit for bit: identical steps, keys and values (a resumed run and
    the uninterrupted one, or two same-seed runs, on one machine; tests/test_reproducible.py)."""
    assert len(a) == len(b), (len(a), len(b))
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys(), (ra.get("global_step"), ra.keys() ^ rb.keys())
        assert ra == rb, (ra["global_step"], {k: (v, rb[k]) for k, v in ra.items() if rb[k] != v})


RANK_TIMING = ("time/", "tokens_per_sec", "async/queue_size", "time_frac")


def assert_same_run_across_ranks(one: list[dict], two: list[dict]):
    """A one-process run and its run on several trainer ranks: rel 1e-4 / abs 1e-5 on every logged number except
    timings (tests/test_distributed.py's docstring says why)."""
    assert len(one) == len(two) and len(one) > 1, (len(one), len(two))
    for a, b in zip(one, two):
        assert a.keys() == b.keys(), (a["global_step"], a.keys() ^ b.keys())
        for k, v in a.items():
            if isinstance(v, (int, float)) and not any(t in k for t in RANK_TIMING):
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (a["global_step"], k, v, b[k])


# ---------------------------------------------------------------- markers (registered in pyproject.toml)
# unit: runs in-process, in seconds (`pytest -m unit`, the fast loop); run: starts a subprocess (an algorithm or
# reproduce script, a launch file's dry run, an interpreter); torchrun: starts torchrun; vllm: starts vLLM.
SLOW_MARKERS = ("run", "torchrun", "vllm")
STARTS = {"run": re.compile(r"\brun_script\(|\bsubprocess\."), "torchrun": re.compile(r"\brun_torchrun\(")}
FIXTURE_MARKERS = {"toy_path": "run", "tiny_vllm_model_path": "vllm"}  # session fixtures that start those


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Every test without ``run``, ``torchrun`` or ``vllm`` (set by its module's ``pytestmark`` or on the test) gets
    ``unit``. A test whose own code calls run_script, run_torchrun or subprocess, or that uses a fixture starting a
    script or vLLM, without the matching marker is a collection error, so the fast loop stays fast."""
    missing = []
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        if not marks & set(SLOW_MARKERS):
            item.add_marker(pytest.mark.unit)
        source = inspect.getsource(item.function) if hasattr(item, "function") else ""
        needs = {mark for mark, pattern in STARTS.items() if pattern.search(source)}
        needs |= {FIXTURE_MARKERS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_MARKERS}
        if needs - marks:
            missing.append(f"{item.nodeid}: mark it {', '.join(sorted(needs - marks))}")
    if missing:
        raise pytest.UsageError(
            "a test that starts a subprocess, torchrun or vLLM needs its marker (tests/conftest.py):"
            "\n  " + "\n  ".join(missing)
        )
