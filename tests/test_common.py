"""Every helper in common/: tasks and verifiers, model resolution, engine, batching, tracking, checkpoints."""

import copy
import fcntl
import json
import math
import os
import platform
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from common import models
from common.checkpoint import (
    NonFiniteGuard,
    given_flags,
    load_checkpoint,
    lock_run_folder,
    resume_needs_current_weights,
    resumed_args,
    rng_state,
    run_folder,
    save_checkpoint,
    save_model,
    set_rng_state,
    signals_held,
)
from common.cli import quiet_startup_interrupts
from common.distributed import full_model_state
from common.engine import HFEngine, inverse_cdf_sample, sample, sampling_logprobs, weight_payload
from common.evaluation import greedy_eval
from common.logprobs import collate, left_pad, pad_float, position_ids_from_mask, response_logprobs, side_autocast
from common.memory import release_free_memory
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import (
    TEMPLATES,
    correctness_reward,
    encode_prompt,
    extract_hash_answer,
    extract_last_number,
    hub_offline,
    load_benchmark,
    load_rows,
    make_arithmetic_task,
    make_chain_task,
    make_task,
    normalise_row,
    read_rows,
)
from common.tracking import Tracker, format_duration, parse_row, progress_line, read_metrics


# ------------------------------------------------------------------ tasks and verifiers
@pytest.mark.parametrize(
    "text,expected",
    [
        ("The answer is 42.", "42"),
        ("12 + 30 = 42", "42"),
        ("-7", "-7"),
        ("1,234 apples", "1234"),
        ("3.50", "3.5"),
        ("no digits here", None),
        ("", None),
        ("2.0", "2"),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so 5 + 3 = 8\n#### 8", "8"),
        ("#### 1,000", "1000"),
        ("#### -3 dollars", "-3"),
        ("8", None),
        ("#### first\n#### 9", "9"),
        ("####", None),
    ],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


def test_correctness_reward_is_numeric():
    assert correctness_reward("42", "42.0") == 1.0 and correctness_reward("41", "42") == 0.0
    assert correctness_reward(None, "42") == 0.0


def test_arithmetic_task_is_seeded_and_eval_is_held_out():
    t1, t2 = make_arithmetic_task(digits=2, eval_size=50, seed=3), make_arithmetic_task(digits=2, eval_size=50, seed=3)
    assert t1.train_rows(5, 8) == t2.train_rows(5, 8)
    assert t1.train_rows(5, 8) != t1.train_rows(6, 8)
    assert make_arithmetic_task(2, 50, seed=4).train_rows(5, 8) != t1.train_rows(5, 8)
    assert t1.eval_rows == make_arithmetic_task(2, 50, seed=99).eval_rows  # fixed whatever the seed
    held_out = {(r["a"], r["b"]) for r in t1.eval_rows}
    assert len(held_out) == 50
    for k in range(200):
        assert not held_out & {(r["a"], r["b"]) for r in t1.train_rows(k, 8)}
    row = t1.train_rows(0, 1)[0]
    assert row["answer"] == str(row["a"] + row["b"]) and 10 <= row["a"] <= 99
    assert t1.reward(f"It is {row['answer']}.", row) == 1.0 and t1.reward("It is 0.", row) == 0.0
    assert "Reply with just the number" in t1.prompt(row)


def test_arithmetic_difficulty_knob():
    row = make_arithmetic_task(digits=4, eval_size=10).train_rows(0, 1)[0]
    assert 1000 <= row["a"] <= 9999 and 1000 <= row["b"] <= 9999
    with pytest.raises(SystemExit, match="digits"):
        make_arithmetic_task(digits=0)
    with pytest.raises(SystemExit, match="too large"):
        make_arithmetic_task(digits=1, eval_size=80)


def check_chain(row: dict, digits: int) -> list[int]:
    """Recompute a chain problem from its question alone: every solution line, the result and the bounds."""
    import re

    terms = row["question"].split(" ")
    value, ops = int(terms[0]), list(zip(terms[1::2], map(int, terms[2::2])))
    assert 0 <= value < 10**digits and 3 <= len(ops) == row["steps"] <= 14
    lines = row["solution"].split("\n")
    values = [value]
    for line, (op, b) in zip(lines, ops):
        assert 1 <= b < 10**digits and op in "+-"
        new = value + b if op == "+" else value - b
        assert line == f"{value} {op} {b} = {new}" and 0 <= new < 10**digits
        value = new
        values.append(value)
    assert lines[-1] == f"#### {value}" and row["answer"] == str(value) and len(lines) == len(ops) + 1
    assert re.fullmatch(r"[0-9]+( [+-] [0-9]+)+", row["question"])
    return values


def test_chain_task_works_each_problem_one_operation_per_line():
    task = make_task("chain", digits=1, eval_size=300)
    counts = [check_chain(r, 1) and r["steps"] for r in task.eval_rows + task.train_rows(0, 300)]
    assert set(counts) == set(range(3, 15))  # every length occurs
    assert counts.count(3) > counts.count(6) > counts.count(12)  # P(n) proportional to n^-1.5
    assert 5.5 < sum(counts) / len(counts) < 6.7
    row = task.eval_rows[0]
    assert task.reward(row["solution"], row) == 1.0  # the reference solution is right
    wrong = row["solution"].replace(f"#### {row['answer']}", f"#### {int(row['answer']) + 1}")
    assert task.reward(wrong, row) == 0.0 and task.reward(row["answer"], row) == 0.0  # the "####" line counts
    # raw text that ends with the expression on its own line: the line the first step reads, as later steps do
    assert task.prompt(row) == f"One step per line, then #### result.\n{row['question']}\n"
    assert not task.chat and task.info["verifier"] == "hash" and task.info["ops"] == [3, 14]


def test_chain_task_is_seeded_held_out_and_has_a_difficulty_knob():
    t1, t2 = make_chain_task(digits=1, eval_size=50, seed=3), make_chain_task(digits=1, eval_size=50, seed=3)
    assert t1.train_rows(5, 8) == t2.train_rows(5, 8) and t1.train_rows(5, 8) != t1.train_rows(6, 8)
    assert make_chain_task(1, 50, seed=4).train_rows(5, 8) != t1.train_rows(5, 8)
    assert t1.eval_rows == make_chain_task(1, 50, seed=99).eval_rows  # fixed whatever the seed
    assert t1.eval_rows == make_chain_task(1, 80).eval_rows[:50]  # a larger eval set extends a smaller one
    held_out = {r["question"] for r in t1.eval_rows}
    assert len(held_out) == 50
    # short chains repeat often enough to collide; none reaches training
    assert not any(r["question"] in held_out for k in range(300) for r in t1.train_rows(k, 16))
    for row in make_chain_task(digits=3, eval_size=5).eval_rows:
        check_chain(row, 3)
    with pytest.raises(SystemExit, match="digits"):
        make_chain_task(digits=0)
    with pytest.raises(SystemExit, match="chain is generated"):
        make_task("chain", data_path="x.jsonl")


def test_unknown_task_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown; choose one of arithmetic, chain, gsm8k"):
        make_task("chess")


def write_gsm8k(folder, train_rows, test_rows):
    folder.mkdir(exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (folder / f"{name}.jsonl").write_text(
            "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
        )
    return folder


def test_gsm8k_local_folder(tmp_path):
    rows = [{"question": f"Q{i}: 1 + {i}?", "answer": f"1 + {i} = {1 + i}\n#### {1 + i}"} for i in range(14)]
    task = make_task("gsm8k", data_path=str(write_gsm8k(tmp_path / "g", rows[:10], rows[10:])), eval_size=3, seed=1)
    assert len(task.eval_rows) == 3 and task.eval_rows[0]["answer"] == "11"
    epoch = [r["question"] for r in task.train_rows(0, 10)]
    assert sorted(epoch) == sorted(r["question"] for r in rows[:10])  # one batch of 10 = one full shuffled epoch
    assert task.train_rows(1, 10) != task.train_rows(0, 10)  # the next epoch is reshuffled
    assert task.reward("so it is\n#### 12", task.eval_rows[1]) == 1.0
    assert task.reward("12", task.eval_rows[1]) == 0.0  # GSM8K's verifier wants '####'
    assert "####" in task.prompt(task.eval_rows[0])


@pytest.mark.parametrize(
    "bad,match",
    [
        ("{not json", "row 2 is not valid JSON"),
        (json.dumps({"question": "q"}), r"row 2: no answer \(looked for 'answer'"),
        (json.dumps([1, 2]), "row 2 is not a JSON object"),
        (
            json.dumps({"question": "q", "answer": "no hash #### here"}),
            "row 2: answer does not end with '#### <number>'",
        ),
        (
            json.dumps({"question": "q", "answer": "the answer is 12"}),
            r"grpo checks a plain number \(hash\), but 1 of 2",
        ),
    ],
)
def test_gsm8k_malformed_rows_name_file_and_row(tmp_path, bad, match):
    good = {"question": "q", "answer": "#### 1"}
    folder = write_gsm8k(tmp_path / "g", [good, bad], [good])
    with pytest.raises(SystemExit, match=match) as e:
        make_task("gsm8k", data_path=str(folder))
    assert "train.jsonl" in str(e.value) or "training" in str(e.value)


def test_gsm8k_missing_files(tmp_path):
    with pytest.raises(SystemExit, match="expected a folder with train.jsonl"):
        make_task("gsm8k", data_path=str(tmp_path / "nowhere"))


def test_read_rows_skips_blank_lines_and_rejects_empty(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"x": "1"}\n\n{"x": "2"}\n')
    assert [r["x"] for r in read_rows(f)] == ["1", "2"]
    f.write_text("\n")
    with pytest.raises(SystemExit, match="no rows"):
        read_rows(f)
    with pytest.raises(SystemExit, match="^--eval-data-path .*a.jsonl: the file has no rows"):
        read_rows(f, "--eval-data-path")
    with pytest.raises(SystemExit, match="unknown file type '.csv'"):
        read_rows(tmp_path / "a.csv")


def test_encode_prompt_uses_chat_template(tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    ids = encode_prompt(tok, "What is 1 + 1?")
    text = tok.decode(ids)
    assert "<|im_start|>user\nWhat is 1 + 1?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "hi", chat_template=False) == tok("hi")["input_ids"]


# ------------------------------------------------------------------ models
def test_resolve_model_errors_and_folders(tmp_path, tiny_model_path):
    with pytest.raises(SystemExit, match="no such folder"):
        resolve_model(str(tmp_path / "missing-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    assert resolve_model(tiny_model_path) == tiny_model_path
    assert resolve_model("org/some-model") == "org/some-model"  # a hub id is passed through
    run = tmp_path / "runs" / "r"  # a run folder: its config.json holds the run's settings, model/ its trained model
    (run / "model").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 1, "model": "default"}))
    with pytest.raises(SystemExit, match=r"config.json is not a model's \(no model_type\)") as e:
        resolve_model(str(run))
    assert "trained model" not in str(e.value)  # model/ has no config.json yet
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=f"; its trained model is {run / 'model'}.$"):
        resolve_model(str(run))
    (run / "config.json").write_text("not json")
    with pytest.raises(SystemExit, match="not a model's"):
        resolve_model(str(run))


def test_default_model_is_converted_once_then_cached(tmp_path, monkeypatch, default_tokenizer_path):
    # the cached folder is reused: conversion must not run again
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted a second time"))
    assert resolve_model(None) == default_tokenizer_path == resolve_model("default")
    assert models.find_default_gguf().name == models.GGUF_NAME


def test_convert_gguf_produces_a_loadable_folder(tmp_path, monkeypatch, default_tokenizer_path):
    calls = []
    real = models.convert_gguf
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "convert_gguf", lambda *a: calls.append(a) or real(*a))
    path = resolve_model(None)
    assert len(calls) == 1 and path.startswith(str(tmp_path))
    resolve_model(None)
    assert len(calls) == 1
    m = load_model(path)
    assert m.config.tie_word_embeddings and sum(p.numel() for p in m.parameters()) == 134_515_008
    ref = load_model(default_tokenizer_path)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_load_model_on_the_meta_device_has_the_structure_and_generation_config(tiny_model_path, tmp_path):
    real = load_model(tiny_model_path)
    meta = load_model(tiny_model_path, meta=True)
    assert all(p.is_meta for p in meta.parameters()) and all(b.is_meta for b in meta.buffers())
    assert {n: p.shape for n, p in meta.state_dict().items()} == {n: p.shape for n, p in real.state_dict().items()}
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied, as loaded
    # the eos ids of the folder's generation_config.json, which from_config alone would not read
    real.generation_config.eos_token_id = [2, 7]
    save_model(real, load_tokenizer(tiny_model_path), real.state_dict(), tmp_path / "m")
    assert load_model(str(tmp_path / "m"), meta=True).generation_config.eos_token_id == [2, 7]


def test_load_model_unknown_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read once, when the hub was imported
    with pytest.raises(SystemExit, match="could not load it"):
        load_model("asyncrl-test/does-not-exist")


# ------------------------------------------------------------------ engine and batching
def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_sampling_logprobs_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    lp = sampling_logprobs(logits, 0.5, 1.0)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.5, -1))
    lp = sampling_logprobs(logits, 1.0, 0.7)  # p = .64 .24 .09 .03: nucleus {0, 1}
    p = torch.softmax(logits, -1)[0, :2]
    torch.testing.assert_close(lp[0, :2].exp(), p / p.sum())
    assert torch.isinf(lp[0, 2:]).all()


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    return load_model(tiny_model_path), tok


def tiny_prompts(tok, n=6):
    return [encode_prompt(tok, f"What is {i} + {i + 3}?") for i in range(n)]


def test_inverse_cdf_sample_draws_the_categorical_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([inverse_cdf_sample(probs.log(), gen) for _ in range(20000)])  # [draws, rows]
    freq = torch.stack([torch.bincount(draws[:, r], minlength=5) for r in range(3)]).float() / 20000
    assert torch.all(freq[probs == 0] == 0)  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs, atol=0.015)  # 4+ standard errors at 20000 draws
    unnormalised = torch.log(torch.tensor([[2.0, 6.0]]))  # log-probs that do not sum to 1 still sample p / sum
    assert abs(torch.stack([inverse_cdf_sample(unnormalised, gen) for _ in range(8000)]).float().mean() - 0.75) < 0.02


def test_sample_returns_valid_responses(tiny):
    model, tok = tiny
    prompts = tiny_prompts(tok)
    res, lps, trunc = sample(
        model,
        prompts,
        max_new_tokens=7,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    for r, lp, tr in zip(res, lps, trunc):
        assert 1 <= len(r) <= 7 and len(lp) == len(r) and all(x <= 0 for x in lp)
        assert tr == (tok.eos_token_id not in r)
        assert tok.eos_token_id not in r[:-1]
    again = sample(
        model,
        prompts,
        max_new_tokens=7,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert again[0] == res  # seeded sampling is reproducible


def test_finished_rows_leaving_the_forward_and_the_engine_batching_change_nothing_but_speed(tiny):
    """With bf16 weights a row's tokens and log-probs do not depend on the rows beside it, so dropping finished rows
    from the forward (compact) and the engine's batch size (--gen-batch-size; it draws every sample's uniforms at
    once) change the speed only."""
    model, tok = tiny
    prompts = tiny_prompts(tok, 6)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    u = torch.rand(6 * 3, 12, generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, temperature=1.5, n=3)
    full = sample(bf16, prompts, compact=False, uniforms=u, autocast=False, **kw)
    assert sample(bf16, prompts, uniforms=u, autocast=False, **kw) == full
    assert len({len(r) for r in full[0]}) > 2  # rows finish at different steps: rows did leave the forward
    outs = [
        HFEngine(model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, max_batch=mb).generate(
            prompts, n=3, max_new_tokens=12, temperature=1.5, seed=3
        )
        for mb in (3, 6, 64)
    ]
    assert outs[0] == outs[1] == outs[2]


def test_engine_logprobs_match_trainer(tiny):
    """Behaviour log-probs from the engine equal the trainer's log-probs for the same weights and temperature:
    within 1e-4 with an fp32 engine and fp32 trainer; within 0.1 mean |diff| for bf16 engine vs bf16 autocast."""
    model, tok = tiny
    prompts = [p for p in tiny_prompts(tok, 4) for _ in range(2)]
    for dtype, autocast, tol in ((torch.float32, False, 1e-4), (torch.bfloat16, True, 0.1)):
        engine = HFEngine(model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, dtype=dtype)
        outs = engine.generate(prompts, max_new_tokens=10, temperature=0.7, seed=1)
        assert all(o["version"] == 0 for o in outs)
        batch = collate(prompts, [o["response"] for o in outs], tok.pad_token_id)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = response_logprobs(model, batch, temperature=0.7, with_grad=False)
        behav = pad_float([o["logprobs"] for o in outs], logp.shape[1])
        diff = (logp - behav).abs()[batch["response_mask"]]
        assert diff.mean() < tol, (dtype, diff.mean())


def test_threads_beside_the_trainer_leave_its_autocast_cast_cache(tiny):
    """torch's autocast cache is process-wide and any thread's autocast exit clears it; a clear in the middle of the
    trainer's forward gives a weight a second cast node, and its gradient other rounding (the cause of same-seed runs
    that differed at s > 0). The engine's generation and a side_autocast forward in another thread must not clear it;
    a plain torch.autocast there does (the hazard the test detects), and side_autocast computes the same values."""
    model, tok = tiny
    engine = HFEngine(model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    batch = collate(tiny_prompts(tok, 2), [[5, 6, 7], [8, 9]], tok.pad_token_id)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def weight_cast(y):  # the autograd node that casts the fp32 weight to bf16 for this use
        return [n for n, _ in y.grad_fn.next_functions if type(n).__name__ == "ToCopyBackward0"][0]

    def cache_survives(side) -> bool:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = lin(x)
            t = threading.Thread(target=side)
            t.start()
            t.join()
            return weight_cast(first) is weight_cast(lin(x))

    def ref_forward(ctx):
        with ctx, torch.no_grad():
            return response_logprobs(model, batch, with_grad=False)[0]

    assert cache_survives(lambda: None)
    assert cache_survives(lambda: engine.generate(tiny_prompts(tok, 2), max_new_tokens=4, seed=0))
    assert cache_survives(lambda: ref_forward(side_autocast("cpu")))
    assert not cache_survives(lambda: ref_forward(torch.autocast("cpu", dtype=torch.bfloat16)))
    assert torch.equal(ref_forward(side_autocast("cpu")), ref_forward(torch.autocast("cpu", dtype=torch.bfloat16)))
    assert not torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()  # the state is restored


def test_shared_prefill_matches_repeated_prompts(tiny):
    """n samples per prompt (one prefill, repeated KV cache) give the same log-probs as repeating the prompt."""
    model, tok = tiny
    engine = HFEngine(model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, dtype=torch.float32)
    prompts = tiny_prompts(tok, 3)
    shared = engine.generate(prompts, n=4, max_new_tokens=8, temperature=0.9, seed=5)
    assert len(shared) == 12
    repeated = [p for p in prompts for _ in range(4)]
    batch = collate(repeated, [o["response"] for o in shared], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, temperature=0.9, with_grad=False)
    behav = pad_float([o["logprobs"] for o in shared], logp.shape[1])
    assert (logp - behav).abs()[batch["response_mask"]].max() < 1e-4
    greedy_shared = engine.generate(prompts, n=2, max_new_tokens=8, greedy=True)
    greedy_rep = engine.generate(repeated[::2], max_new_tokens=8, greedy=True)
    assert [o["response"] for o in greedy_shared] == [o["response"] for o in greedy_rep]


def test_engine_weight_sync(tiny):
    model, tok = tiny
    engine = HFEngine(model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, dtype=torch.float32)
    prompts = tiny_prompts(tok, 3)
    before = engine.generate(prompts, max_new_tokens=6, seed=0)
    perturbed = {n: p.detach() + 0.5 * torch.randn_like(p) for n, p in model.named_parameters()}
    engine.load_weights(perturbed.items(), version=7)
    after = engine.generate(prompts, max_new_tokens=6, seed=0)
    assert all(o["version"] == 7 for o in after)
    assert [o["logprobs"] for o in after] != [o["logprobs"] for o in before]
    engine.load_weights(model.named_parameters(), version=8)
    restored = engine.generate(prompts, max_new_tokens=6, seed=0)
    assert [o["response"] for o in restored] == [o["response"] for o in before]
    assert not any(p.data_ptr() == q.data_ptr() for p in engine.model.parameters() for q in model.parameters())


def test_engine_before_step_swaps_weights_mid_generation(tiny):
    """Interruptible generation: a callback loads new weights before decoding step 3. Tokens 0-2 carry version 0
    and the old weights' log-probs, tokens 3+ version 1 and the new weights' log-probs. Only the final norm
    changes, so the kept KV cache of the earlier tokens is the same under both weights and the check is exact."""
    import copy

    model, tok = tiny
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.model.norm.weight.mul_(3.0)
    # no stop token (-1 is never sampled): every response runs the full 8 steps
    engine = HFEngine(model, eos_ids=[-1], pad_id=tok.pad_token_id, dtype=torch.float32)
    prompts = tiny_prompts(tok, 3)

    def swap(t):
        return engine.load_weights(new.named_parameters(), version=1) if t == 3 else None

    outs = engine.generate(prompts, n=2, max_new_tokens=8, temperature=0.9, seed=3, before_step=swap)
    assert engine.version == 1
    assert all(o["versions"] == [0, 0, 0, 1, 1, 1, 1, 1] and o["version"] == 0 for o in outs)
    batch = collate([p for p in prompts for _ in range(2)], [o["response"] for o in outs], tok.pad_token_id)
    with torch.no_grad():
        lp_old, _ = response_logprobs(model, batch, temperature=0.9, with_grad=False)
        lp_new, _ = response_logprobs(new, batch, temperature=0.9, with_grad=False)
    behav = pad_float([o["logprobs"] for o in outs], 8)
    assert (behav - lp_old)[:, :3].abs().max() < 1e-4
    assert (behav - lp_new)[:, 3:].abs().max() < 1e-4
    assert (behav - lp_old)[:, 3:].abs().max() > 1e-2  # the swap really changed the sampling distribution
    plain = engine.generate(prompts, max_new_tokens=4, seed=0)  # no callback: one version throughout
    assert all(o["versions"] == [1] * len(o["response"]) and o["version"] == 1 for o in plain)


def test_collate_layout():
    b = collate([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[True, True, False], [True, True, True]]
    assert b["prompt_len"] == 3 and b["position_ids"][1].tolist()[2:] == [0, 1, 2, 3]
    g = collate([[4], [1, 2, 3], [4], [1, 2, 3]], [[5], [6], [7], [8]], pad_id=0)
    assert g["prompt_index"].tolist() == [0, 1, 0, 1]
    assert g["unique_ids"].tolist() == [[0, 0, 4], [1, 2, 3]] and g["unique_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert pad_float([[0.5], [1.0, 2.0]], 3).tolist() == [[0.5, 0, 0], [1.0, 2.0, 0]]


def test_response_logprobs_match_full_log_softmax(tiny):
    model, tok = tiny
    prompts = tiny_prompts(tok, 3)
    batch = collate(prompts, [[10, 11, 12], [13], [14, 15]], tok.pad_token_id)
    logp, ent = response_logprobs(model, batch, temperature=0.8, chunk_tokens=2)  # several chunks
    with torch.no_grad():
        logits = (
            model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits.float()
            / 0.8
        )
    P = batch["prompt_len"]
    full = torch.log_softmax(logits[:, P - 1 : -1], -1)
    ref = full.gather(-1, batch["response_ids"][..., None]).squeeze(-1) * batch["response_mask"]
    torch.testing.assert_close(logp.detach(), ref, atol=1e-5, rtol=1e-5)
    ref_ent = -(full.exp() * full).sum(-1) * batch["response_mask"]
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    logp.sum().backward()  # gradients flow through the checkpointed chunks
    assert model.get_output_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "responses",
    [
        [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [20], [21, 22]],  # ragged responses
        [[10], [11], [12], [13], [14], [15]],  # one token each: only the prompt pass
    ],
)
def test_shared_prompt_pass_matches_full_sequences(tiny, responses):
    """Running each distinct prompt once and gathering its KV cache gives the full-sequence log-probs and
    gradients (fp32), with prompts of different lengths (left padding) in the same batch."""
    model, tok = tiny
    u = tiny_prompts(tok, 2) + [encode_prompt(tok, "What is 100 + 2000? Reply with just the number.")]
    prompts = [u[i] for i in (0, 2, 1, 0, 2, 2)]
    batch = collate(prompts, responses, tok.pad_token_id)
    assert len(batch["unique_ids"]) == 3 and len(set(map(len, u))) > 1
    results = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp, ent = response_logprobs(model, batch, temperature=0.8, share_prompts=share)
        (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    (lp_s, ent_s, g_s), (lp_f, ent_f, g_f) = results
    torch.testing.assert_close(lp_s, lp_f, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_s, ent_f, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_s, g_f):  # fp32 summation order differs: compare relative to the gradient's norm
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8


# ------------------------------------------------------------------ tracking and checkpoints
def test_format_duration_and_progress_line():
    assert [format_duration(x) for x in (12, 75, 3700)] == ["12s", "1m15s", "1h01m"]
    line = progress_line(
        5,
        10,
        50.0,
        40.0,
        {"charts/reward_mean": 0.5, "eval/accuracy": 0.25},
        ["charts/reward_mean", "eval/accuracy", "x"],
    )
    assert line.startswith("[##########----------] 5/10 50s<40s |")
    assert "reward_mean 0.5" in line and "eval.accuracy 0.25" in line
    assert "?" in progress_line(0, 10, 0.0, float("nan"), {}, [])


def test_tracker_eta_uses_recent_updates_and_adds_the_evaluations_to_come(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("common.tracking.time.time", lambda: clock[0])
    tr = Tracker(tmp_path / "run", {})
    assert math.isnan(tr.eta(0, 100, 10))
    clock[0] += 300  # update-0 evaluation after a slow start (engine start): not an update's pace
    tr.log({"eval/accuracy": 0.1}, 0)
    steps = (
        [(1, 60.0, False)]
        + [(v, 2.0, False) for v in range(2, 10)]
        + [(10, 7.0, True)]
        + [(v, 3.0, False) for v in range(11, 21)]
    )  # a slow first update (FIFO warm-up), then 2 s, then 3 s
    for v, dt, evaluated in steps:
        clock[0] += dt
        tr.log({"eval/accuracy": 0.2} if evaluated else {}, v)
    # pace: the last 10 updates without an evaluation (3 s each); update 10's evaluation cost 7 - 3 = 4 s more;
    # evaluations to come at updates 30, 40, 50 and at the end (55): 35 x 3 + 4 x 4
    assert tr.eta(20, 55, 10) == pytest.approx(35 * 3 + 4 * 4)
    assert tr.eta(20, 55, 0) == pytest.approx(35 * 3)
    assert tr.eta(20, 60, 10) == pytest.approx(40 * 3 + 4 * 4)  # 30, 40, 50, 60
    tr.close()
    assert math.isnan(Tracker(tmp_path / "other", {}, enabled=False).eta(5, 10, 0))


def test_save_model_writes_a_folder_from_pretrained_loads(tmp_path, tiny_model_path):
    model, tok = load_model(tiny_model_path), load_tokenizer(tiny_model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    state = full_model_state(model)  # one process: the plain state dict, on the CPU
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    (tmp_path / "m.tmp").mkdir()  # a leftover of a crashed write is replaced
    out = save_model(model, tok, state, tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and (out / "model.safetensors").is_file()
    back, back_tok = load_model(str(out)), load_tokenizer(str(out))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert back_tok.chat_template == tok.chat_template and back_tok("12 + 3")["input_ids"] == tok("12 + 3")["input_ids"]
    assert resolve_model(str(out)) == str(out)  # what --model accepts
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="could not write the trained model"):
        save_model(model, tok, state, tmp_path / "file" / "m")


def test_tracker_writes_jsonl_and_config(tmp_path):
    tr = Tracker(tmp_path / "run", {"lr": 1e-6})
    tr.log({"charts/reward_mean": torch.tensor(0.5), "async/policy_version": 1}, step=1)
    tr.log({"charts/reward_mean": 0.75}, step=2)
    tr.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    elapsed = [r.pop("time/elapsed") for r in rows]  # wall-clock since the run started, on every row
    assert 0 <= elapsed[0] <= elapsed[1] < 60
    assert rows == [
        {"global_step": 1, "charts/reward_mean": 0.5, "async/policy_version": 1},
        {"global_step": 2, "charts/reward_mean": 0.75},
    ]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 1e-6}
    tr = Tracker(tmp_path / "run", {}, resume=2)  # resume appends, and its clock carries on from the last row
    tr.log({"a": 1}, step=3)
    tr.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3 and rows[2]["time/elapsed"] >= elapsed[1]


def test_tracker_resume_drops_rows_after_the_checkpoint(tmp_path):
    """A run killed after its checkpoint at update 2 had logged updates 3 and 4 (the last line torn mid-write): the
    resumed run keeps rows 0-2 and logs 3 and 4 again, one row per update."""
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(
        "".join(json.dumps({"global_step": s, "time/elapsed": float(s)}) + "\n" for s in range(4))
        + '{"global_step": 4, "time/ela'
    )
    tr = Tracker(tmp_path / "run", {}, resume=2)
    assert read_metrics(path) == [{"global_step": s, "time/elapsed": float(s)} for s in range(3)]  # rewritten at once
    assert tr.offset == 2.0  # the clock goes on from the last kept row
    tr.log({"a": 1}, step=3)
    tr.log({"a": 2}, step=4)
    tr.close()
    assert [r["global_step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    assert not list(path.parent.glob("*.tmp"))


def test_parse_row():
    assert parse_row('{"global_step": 1, "x": NaN}')["global_step"] == 1
    assert parse_row("") is None and parse_row("  ") is None
    assert parse_row('{"global_step": 2, "x"') is None  # torn by a kill


def test_tracker_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tr = Tracker(tmp_path / "run", {"lr": 1e-6}, track=True, project="asyncrl-test")
    assert tr.wandb.settings.save_code  # a tracked run keeps the script that produced it
    tr.log({"charts/reward_mean": 0.5}, step=1)
    tr.close()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_checkpoint_roundtrip_and_rng(tmp_path):
    state = {"args": {}, "update": 0, "w": torch.arange(4.0), "rng": rng_state(), "rollouts": [{"k": 1, "outs": [[1]]}]}
    a = torch.rand(3)
    path = save_checkpoint(tmp_path / "c" / "checkpoint.pt", state)
    assert not list(path.parent.glob("*.tmp"))
    loaded = load_checkpoint(tmp_path / "c")  # a run folder works too
    assert torch.equal(loaded["w"], state["w"]) and loaded["rollouts"] == state["rollouts"]
    set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), a)
    with pytest.raises(SystemExit, match="no checkpoint there"):
        load_checkpoint(tmp_path / "nothing")


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "checkpoint.pt", {"args": {}, "update": 1})
    real_save = torch.save

    def disk_full(obj, f):  # writes half a file, then the disk is full
        Path(f).write_bytes(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SystemExit, match="No space left on device") as e:
        save_checkpoint(path, {"update": 2})
    assert "the previous checkpoint" in str(e.value) and "is intact" in str(e.value)
    assert load_checkpoint(path)["update"] == 1 and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit, match="no earlier checkpoint"):  # a first save that fails says so
        save_checkpoint(tmp_path / "other" / "checkpoint.pt", {"update": 1})
    monkeypatch.setattr(torch, "save", real_save)


def test_nonfinite_guard():
    said = []
    guard = NonFiniteGuard(3, log=lambda *a, **k: said.append(a[0]))
    assert guard.check(1, loss=0.5, grad_norm=torch.tensor(2.0))
    assert not guard.check(2, loss=float("nan"), grad_norm=torch.tensor(float("inf")))
    assert said == [
        "update 2: non-finite loss nan, grad_norm inf: optimizer step skipped, weights and optimizer "
        "state unchanged (1 in a row, 1 in the run)"
    ]
    assert guard.check(3, loss=0.1) and guard.streak == 0 and guard.skips == 1  # a finite update ends the streak
    assert not guard.check(4, loss=float("-inf")) and not guard.check(5, loss=float("nan")) and not guard.exhausted
    assert not guard.check(6, loss=float("nan")) and guard.exhausted and guard.skips == 4
    assert "updates 4-6: 3 in a row" in guard.message(6, "runs/x/checkpoint.pt")
    resumed = NonFiniteGuard(0, skips=4, log=lambda *a, **k: None)  # 0: never ends the run; skips carry on
    assert not any(resumed.check(v, loss=float("nan")) for v in range(10)) and not resumed.exhausted
    assert resumed.skips == 14
    with pytest.raises(SystemExit, match="--max-nonfinite-skips must be >= 0"):
        NonFiniteGuard(-1)


def test_resume_needs_current_weights_checks_the_versions_a_checkpoint_kept():
    # a run of 6 batches, U = 1, s = 2, checkpointed at update 3: the engine holds version 1, version 2's payload
    # is queued; batches 3-5 (versions 1, 2, 3) are still to be generated
    ckpt = {"update": 3, "engine_version": 1, "pending_weights": [(2, [])], "args": {"total_updates": 6}}
    needed = {k: max(0, k - 2) for k in range(3, 6)}
    assert resume_needs_current_weights(ckpt, needed)  # version 3 (the checkpoint's own) was never copied
    assert not resume_needs_current_weights({**ckpt, "pending_weights": [(2, []), (3, [])]}, needed)  # kept
    assert not resume_needs_current_weights(ckpt, {3: 1, 4: 2})  # no batch of the resumed run needs version 3
    # extending the run: batch 2 needs version 0, which the engine (now at 1) and the queue no longer hold
    with pytest.raises(SystemExit, match=r"batch 2 must be generated by version 0, .*planned for 6 updates"):
        resume_needs_current_weights(ckpt, {2: 0, **needed})
    # a version at or after the checkpoint's update is made by the resumed run itself: never missing
    assert not resume_needs_current_weights({**ckpt, "engine_version": 3, "pending_weights": []}, {6: 4, 7: 5})


@dataclass
class RunArgs:
    seed: int = 1
    learning_rate: float = 1e-6
    total_updates: int | None = None
    checkpoint_every: int = 0
    track: bool = False
    debug_interrupt_at: int = -1
    resume: str | None = None


def test_resumed_args_take_the_checkpoints_settings_but_resume_and_a_new_total():
    ckpt = {"update": 30, "args": asdict(RunArgs(seed=7, learning_rate=3e-6, total_updates=40))}
    command_line = RunArgs(seed=7, learning_rate=1.0, total_updates=99, resume="runs/x/checkpoint.pt")
    # flags left out and flags given with the checkpoint's value: everything is the checkpoint's but --resume
    resumed = resumed_args(command_line, ckpt, argv=["--resume", "runs/x/checkpoint.pt", "--seed", "7"])
    assert resumed == RunArgs(seed=7, learning_rate=3e-6, total_updates=40, resume="runs/x/checkpoint.pt")
    for argv in (["--total-updates", "99"], ["--total-updates=99"]):  # a longer run
        assert resumed_args(command_line, ckpt, argv=argv).total_updates == 99
    with pytest.raises(SystemExit, match=r"checkpoint is at update 30; pass --total-updates N with N > 30"):
        resumed_args(RunArgs(seed=7, total_updates=30), ckpt, argv=["--total-updates", "30"])


def test_resumed_args_apply_the_flags_that_change_no_numerics_and_refuse_the_others():
    ckpt = {"update": 3, "args": asdict(RunArgs(seed=7, total_updates=40))}
    given = RunArgs(seed=2, learning_rate=0.5, checkpoint_every=5, track=True, debug_interrupt_at=4, resume="r")
    argv = ["--resume", "r", "--checkpoint-every=5", "--track", "--debug-interrupt-at", "4"]
    assert resumed_args(given, ckpt, argv=argv) == RunArgs(
        seed=7, total_updates=40, checkpoint_every=5, track=True, debug_interrupt_at=4, resume="r"
    )
    off = resumed_args(RunArgs(seed=7, resume="r"), {**ckpt, "args": {**ckpt["args"], "track": True}}, ["--no-track"])
    assert off.track is False
    # one line naming every refused flag with both values, and what a resume may change
    argv = ["--resume", "r", "--seed", "2", "--learning_rate", "0.5", "--checkpoint-every", "5"]
    with pytest.raises(SystemExit) as e:
        resumed_args(given, ckpt, argv=argv)
    message = str(e.value)
    assert "\n" not in message and "start a new run" in message
    assert "--seed 2 (the checkpoint's: 7); --learning-rate 0.5 (the checkpoint's: 1e-06)" in message
    assert "may change only --total-updates, --checkpoint-every, --track" in message
    assert given_flags(given, ["--no-track", "--debug-interrupt-at", "1", "2", "--seed=3", "-h"]) == [
        "track",
        "debug_interrupt_at",
        "seed",
    ]


def test_resumed_args_refuse_another_scripts_checkpoint():
    @dataclass
    class OtherArgs(RunArgs):
        exp_name: str = "m2po"
        tau: float = 0.04

    @dataclass
    class ThisArgs(RunArgs):
        exp_name: str = "grpo"

    ckpt = {"update": 3, "args": asdict(OtherArgs(total_updates=6))}
    with pytest.raises(SystemExit) as e:
        resumed_args(ThisArgs(resume="runs/x"), ckpt, argv=[])
    assert str(e.value) == (
        "--resume runs/x: written by m2po.py, whose settings (tau) grpo.py does not have; resume it with the script "
        "that wrote it."
    )


def test_load_checkpoint_refuses_an_empty_truncated_or_foreign_file(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint.pt", {"args": {"seed": 1}, "update": 2, "w": torch.zeros(1000)})
    whole = path.read_bytes()
    for cut in (b"", whole[: len(whole) // 2]):  # a copy that stopped, a disk that filled
        path.write_bytes(cut)
        with pytest.raises(SystemExit, match=rf"--resume {path}: not a readable checkpoint \({len(cut)} bytes; "):
            load_checkpoint(tmp_path)
    torch.save([1, 2], path)
    with pytest.raises(SystemExit, match="not a checkpoint of these scripts"):
        load_checkpoint(path)


def new_run(tmp_path, monkeypatch, **kw):
    """run_folder's view of a script's Args, from ``tmp_path`` as the working folder."""
    monkeypatch.chdir(tmp_path)
    return type("Args", (), dict(dict(resume=None, run_name="a", task="t", exp_name="grpo", seed=1), **kw))()


def test_run_folder_is_made_locked_and_left_as_found(tmp_path, monkeypatch):
    args = new_run(tmp_path, monkeypatch, run_name=None)
    monkeypatch.setattr("common.checkpoint.time.time", lambda: 1234.5)
    assert run_folder(args, 1) == os.path.join("runs", "t__grpo__1__1234") and args.run_name == "t__grpo__1__1234"
    assert not (tmp_path / "runs").exists()  # rank 0 makes it
    release = lock_run_folder("runs/a")
    assert (tmp_path / "runs" / "a" / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(SystemExit) as e:  # a second run in the same folder, while the first is alive
        lock_run_folder("runs/a")
    assert str(e.value) == (
        f"runs/a is in use by another run (process {os.getpid()}); pick another --run-name, or wait for it to end."
    )
    monkeypatch.setattr("common.checkpoint.os.getpid", lambda: -1)  # a forked child's exit: not its lock to drop
    release()
    assert (tmp_path / "runs" / "a" / ".lock").exists()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    release()
    release()  # atexit calls it again: nothing left to do
    assert not (tmp_path / "runs").exists()  # a run that stopped before writing anything leaves no folder
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / ".lock").write_text("999999\n")  # left by a killed run: no process holds it
    lock_run_folder("runs/a")()
    assert os.listdir(tmp_path / "runs" / "a") == []  # the folder was there before: it stays


def test_signals_held_deliver_each_signal_once_after_the_block(tmp_path, monkeypatch):
    """Ctrl-C while the run folder is made and locked (the lock file exists, its clean-up is not yet registered)
    comes after the clean-up is registered, so the exit it causes leaves no folder; outside the main thread the
    block runs as is."""
    got, before = [], [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: got.append(signum))
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM, signal.SIGINT]  # once each, in the order they came
        done = []
        thread = threading.Thread(target=lambda: done.append(signals_held().__enter__() is None))
        thread.start()
        thread.join()
        assert done == [True]

        def stop(signum, frame):
            raise SystemExit(130)

        signal.signal(signal.SIGINT, stop)
        monkeypatch.chdir(tmp_path)
        real_flock, registered = fcntl.flock, []
        monkeypatch.setattr("common.checkpoint.atexit.register", registered.append)
        monkeypatch.setattr(
            "common.checkpoint.fcntl.flock", lambda f, how: (real_flock(f, how), signal.raise_signal(signal.SIGINT))
        )
        with pytest.raises(SystemExit) as e:
            lock_run_folder("runs/a")
        assert e.value.code == 130 and len(registered) == 1  # the interrupt came after the clean-up was registered
        registered[0]()
        assert not (tmp_path / "runs").exists()
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_run_folder_refuses_to_overwrite_a_run(tmp_path, monkeypatch):
    args = new_run(tmp_path, monkeypatch)
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")  # a run that stopped before logging: the name is free
    lock_run_folder(folder)()
    (folder / "metrics.jsonl").write_text('{"global_step": 0}\n')
    (folder / "model").mkdir()
    with pytest.raises(SystemExit) as e:
        run_folder(args, 0)
    assert str(e.value) == "runs/a already holds a run (metrics.jsonl, model): pick another --run-name."
    (folder / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"\(metrics.jsonl, model, checkpoint.pt\): pick another --run-name, or "):
        run_folder(args, 0)
    assert sorted(os.listdir(folder)) == ["checkpoint.pt", "metrics.jsonl", "model"]  # as it was: no .lock left
    (tmp_path / "blocked").write_text("")  # a file where the folder should go (root may write anywhere)
    with pytest.raises(SystemExit, match=r"^cannot make the run folder blocked/x \(.*\): run from a folder you can"):
        lock_run_folder("blocked/x")


def test_a_resumed_run_continues_in_the_checkpoints_folder(tmp_path, monkeypatch, capsys):
    """Wherever the folder was moved: its name is the run name."""
    for given, name in (("moved/B/checkpoint.pt", "B"), ("moved/C", "C")):  # the checkpoint, or its folder
        (tmp_path / "moved" / name).mkdir(parents=True)
        args = new_run(tmp_path, monkeypatch, resume=given, run_name="A")
        assert run_folder(args, 0, {"update": 3}) == os.path.join("moved", name) and args.run_name == name
        assert capsys.readouterr().out == f"resumed at update 3: the run continues in {os.path.join('moved', name)}\n"
    assert not (tmp_path / "runs").exists()


STARTUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)


def test_quiet_startup_interrupts_end_with_one_line_and_status_130(capsys):
    before, hook = [signal.getsignal(sig) for sig in STARTUP_SIGNALS], sys.unraisablehook
    try:
        quiet_startup_interrupts()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(SystemExit) as e:
                signal.raise_signal(sig)
            assert e.value.code == 130
            assert capsys.readouterr().err == "interrupted during start-up, before any update: nothing to save\n"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in zip(STARTUP_SIGNALS, before):
            signal.signal(sig, handler)
        sys.unraisablehook = hook


def test_a_swallowed_startup_interrupt_is_raised_again_until_the_process_exits(capsys):
    """A SystemExit swallowed where the signal lands (an extension module's init, as numpy.random's Cython module
    does; a __del__ or weakref callback, which would also print a traceback) does not keep the start-up going: the
    exit comes again from the timer, with neither a second line nor a traceback."""
    before = [signal.getsignal(sig) for sig in STARTUP_SIGNALS], sys.unraisablehook

    class LandsInDel:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    try:
        sys.unraisablehook = sys.__unraisablehook__  # Python's own, which prints to stderr (pytest's warns)
        quiet_startup_interrupts(every=0.05)
        LandsInDel()  # collected at once: the SystemExit is raised in its __del__, where Python ignores it
        assert capsys.readouterr().err == "interrupted during start-up, before any update: nothing to save\n"
        t0 = time.time()
        with pytest.raises(SystemExit) as e:
            time.sleep(5)
        assert e.value.code == 130 and time.time() - t0 < 1 and capsys.readouterr().err == ""
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(0.05)  # armed until the exit handlers run
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in zip(STARTUP_SIGNALS, before[0]):
            signal.signal(sig, handler)
        sys.unraisablehook = before[1]


def test_a_failed_metrics_write_keeps_whole_rows_and_says_so(tmp_path):
    tr = Tracker(tmp_path / "run", {})
    tr.log({"a": 1}, step=1)
    real = tr.file

    class DiskFills:  # the disk takes half of the next row, then is full
        def __init__(self):
            self.calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls == 1:
                return real.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def fileno(self):
            return real.fileno()

    tr.file = DiskFills()
    with pytest.raises(SystemExit) as e:
        tr.log({"a": 2}, step=2)
    assert str(e.value) == (
        f"could not write {tmp_path / 'run' / 'metrics.jsonl'} (No space left on device); it holds every row before "
        f"update 2, whole. Free disk space; --resume {tmp_path / 'run'} continues from the run's last checkpoint, if "
        f"it wrote one."
    )
    tr.file = real
    tr.close()
    assert [r["a"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="could not write to the run folder .*file/run"):
        Tracker(tmp_path / "file" / "run", {})


def test_greedy_eval_scores_every_problem_once_in_any_batch_size(tiny):
    model, tok = tiny
    prompts, rows = tiny_prompts(tok, n=7), list(range(7))
    responses, _, truncated = sample(  # the independent computation: one greedy pass over every prompt
        model,
        prompts,
        max_new_tokens=6,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        greedy=True,
        autocast=False,
    )
    texts = tok.batch_decode(responses, skip_special_tokens=True)
    rewarded = {0, 2, 5}  # the problems a verifier accepts

    def reward(text, row):
        assert texts[row] == text  # each problem is scored against its own row
        return 1.0 if row in rewarded else 0.0

    expected = {
        "eval/accuracy": len(rewarded) / 7,
        "eval/truncated_frac": sum(truncated) / 7,
        "eval/response_length_mean": sum(map(len, responses)) / 7,
    }
    model.eval()
    for batch_size in (1, 3, 64):
        metrics = greedy_eval(
            model,
            tok,
            prompts,
            rows,
            reward,
            eos_ids=[tok.eos_token_id],
            max_new_tokens=6,
            batch_size=batch_size,
            autocast=False,
        )
        assert metrics == pytest.approx(expected) and model.training  # left in train mode
    with pytest.raises(SystemExit, match="--eval-batch-size must be >= 1, got 0"):
        greedy_eval(model, tok, prompts, rows, reward, eos_ids=[1], max_new_tokens=6, batch_size=0, autocast=False)
    model.eval()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status") or platform.libc_ver()[0] != "glibc", reason="needs glibc and /proc"
)
def test_release_free_memory_returns_fragmented_heap_pages():
    # 64 KiB blocks stay below glibc's mmap threshold, so they live on the heap; keeping every 8th one
    # alive pins the heap's top, so free() alone cannot give the pages back: only a trim can.
    blocks = [bytearray(64 * 1024) for _ in range(4096)]  # 256 MiB, touched (bytearray zero-fills)
    kept = blocks[7::8]
    del blocks
    before = _rss_mib()
    assert release_free_memory() is True
    after = _rss_mib()
    assert before - after > 150, (before, after)  # ~224 MiB of the 256 MiB were free
    assert all(len(b) == 64 * 1024 and b[0] == 0 and b[-1] == 0 for b in kept)  # live blocks untouched


# ------------------------------------------------------------------ datasets, templates, loaders
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    "name,first_answer,n",
    [
        ("math500", "\\left( 3, \\frac{\\pi}{2} \\right)", 4),
        ("aime24", "204", 2),
        ("amc23", "142", 3),
        ("minerva", "9.6", 3),
        ("olympiadbench", "2", 3),
        ("gsm8k", "18", 3),
    ],
)
def test_benchmarks_load_from_local_fixtures(name, first_answer, n):
    path = FIXTURES / ("gsm8k" if name == "gsm8k" else f"{name}.json")
    rows = load_benchmark(name, str(path))
    assert len(rows) == n and rows[0]["answer"] == first_answer
    assert all(set(r) == {"question", "answer"} and r["question"] and r["answer"] for r in rows)


def test_loader_schema_quirks():
    assert load_benchmark("olympiadbench", str(FIXTURES / "olympiadbench.json"))[2]["answer"] == "2^{1009}"  # '$..$'
    assert load_benchmark("minerva", str(FIXTURES / "minerva.json"))[1]["answer"] == "8.7 \\times 10^{8}"
    assert load_benchmark("aime24", str(FIXTURES / "aime24.json"))[1]["answer"] == "025"
    assert normalise_row({"problem": "p", "answer": [1, 2.5]}, "x")["answer"] == "1, 2.5"
    # MATH as on the hub (DigitalLearningGmbH/MATH-lighteval): the answer is the last \boxed{} of the solution
    assert (
        normalise_row({"problem": "p", "solution": "so \\boxed{1} no, \\boxed{\\frac{a}{b}}."}, "x")["answer"]
        == "\\frac{a}{b}"
    )


def test_unknown_names_are_clear_errors():
    with pytest.raises(SystemExit, match="choose one of gsm8k, math500, aime24"):
        load_benchmark("mmlu")
    with pytest.raises(SystemExit, match="--eval-task 'mmlu' is unknown"):
        make_task("gsm8k", data_path=str(FIXTURES / "gsm8k"), eval_task="mmlu")
    with pytest.raises(SystemExit, match="--prompt-template 'cot' is unknown; choose one of auto, number, chain, grpo"):
        make_task("arithmetic", prompt_template="cot")
    with pytest.raises(SystemExit, match="arithmetic is generated"):
        make_task("arithmetic", eval_task="math500")


@pytest.mark.parametrize(
    "content,match",
    [
        ('[{"problem": "p"}]', r"math_train.json: row 1: no answer \(looked for"),
        ('[{"answer": "1"}]', r"row 1: no question .*fields present: \['answer'\]"),
        ('[{"problem": "p", "answer": ""}]', "row 1: field 'answer' is not a usable answer"),
        ('{"problem": "p"}', "expected a JSON list of objects, got a dict"),
        ('[{"problem": "p", "answer": "1"}, 7]', "row 2 is not a JSON object"),
        ('[{"problem": "p", "answer": "1"', "not valid JSON"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path, content, match):
    (tmp_path / "math_train.json").write_text(content)
    with pytest.raises(SystemExit, match=match):
        make_task("math", data_path=str(tmp_path / "math_train.json"), eval_data_path=str(FIXTURES / "math500.json"))


def test_math_task_from_local_files_trains_and_evaluates():
    task = make_task(
        "math",
        data_path=str(FIXTURES / "math_train.json"),
        eval_data_path=str(FIXTURES / "math500.json"),
        eval_size=0,
        seed=1,
    )
    assert task.info["eval_task"] == "math500" and task.info["prompt_template"] == "m2po" and task.chat
    assert len(task.eval_rows) == 4 and task.info["train_size"] == 4
    row = task.eval_rows[2]  # gold \frac{14}{3}
    assert "\\boxed{}" in task.prompt(row) and row["question"] in task.prompt(row)
    assert task.reward("... so the answer is \\boxed{\\dfrac{14}{3}}", row) == 1.0
    assert task.reward("... \\boxed{14/3}", row) == 1.0 and task.reward("\\boxed{4.6}", row) == 0.0
    assert task.reward("14/3", row) == 0.0  # the m2po verifier needs a \boxed{}
    dapo = make_task(
        "math",
        data_path=str(FIXTURES / "math_train.json"),
        eval_data_path=str(FIXTURES / "math500.json"),
        prompt_template="dapo",
    )
    assert dapo.reward("work\nAnswer: \\frac{14}{3}", row) == 1.0 and "Answer:" in dapo.prompt(row)


def test_numeric_templates_refuse_latex_answers():
    with pytest.raises(SystemExit, match=r"grpo checks a plain number \(hash\), but 3 of 4 math500 answers"):
        make_task(
            "math",
            data_path=str(FIXTURES / "math_train.json"),
            eval_data_path=str(FIXTURES / "math500.json"),
            prompt_template="grpo",
        )


def test_raw_text_templates_skip_the_chat_template():
    task = make_task("gsm8k", data_path=str(FIXTURES / "gsm8k"), prompt_template="tba")
    assert not task.chat and task.prompt(task.eval_rows[0]).startswith("[MATH TASK] Problem:\n")
    assert task.reward("she makes 18 dollars", task.eval_rows[0]) == 1.0  # TBA: the last number
    vine = make_task("gsm8k", data_path=str(FIXTURES / "gsm8k"), prompt_template="vineppo")
    assert not vine.chat and vine.prompt(vine.eval_rows[0]).endswith("\n\nSolution:")
    assert vine.reward("she makes 18 dollars", vine.eval_rows[0]) == 0.0  # VinePPO: after '####' only


def test_deepscaler_and_dapo17k_schemas(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    math = json.loads((FIXTURES / "math_train.json").read_text())
    ds = [{"problem": r["problem"], "answer": r["answer"], "solution": "..."} for r in math]
    (tmp_path / "deepscaler.json").write_text(json.dumps(ds))
    task = make_task(
        "deepscaler", data_path=str(tmp_path / "deepscaler.json"), eval_data_path=str(FIXTURES / "math500.json")
    )
    assert [r["answer"] for r in task.train_rows(0, 4)] and task.info["train_size"] == 4
    wrapped = [
        {
            "data_source": "math_dapo",
            "ability": "MATH",
            "prompt": [{"role": "user", "content": TEMPLATES["dapo"][0].replace("{question}", r["problem"])}],
            "reward_model": {"ground_truth": r["answer"], "style": "rule-lighteval/MATH_v2"},
        }
        for r in math
    ]
    pq.write_table(pa.Table.from_pylist(wrapped), tmp_path / "dapo.parquet")
    task = make_task("dapo17k", data_path=str(tmp_path / "dapo.parquet"), eval_data_path=str(FIXTURES / "math500.json"))
    rows = sorted(task.train_rows(0, 4), key=lambda r: r["answer"])
    assert [r["answer"] for r in rows] == sorted(r["answer"] for r in math)
    assert {r["question"] for r in rows} == {r["problem"].strip() for r in math}  # the DAPO wrapper is removed
    assert task.info["prompt_template"] == "dapo" and task.prompt(rows[0]).count("Solve the following") == 1


def test_training_rows_that_are_eval_problems_are_dropped(tmp_path):
    evals = json.loads((FIXTURES / "math500.json").read_text())
    train = json.loads((FIXTURES / "math_train.json").read_text()) + evals[:2]
    (tmp_path / "train.json").write_text(json.dumps(train))
    task = make_task("math", data_path=str(tmp_path / "train.json"), eval_data_path=str(FIXTURES / "math500.json"))
    assert task.info["train_size"] == 4 and task.info["train_dropped_as_eval"] == 2


def test_hub_failure_says_how_to_use_a_local_copy(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*a, **k):
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr("common.tasks.hub_offline", lambda: False)  # the hub looks reachable; the load fails anyway
    with pytest.raises(
        SystemExit, match=r"could not load math500 from the hub \(HuggingFaceH4/MATH-500.*no internet.*--eval-data-path"
    ) as e:
        load_benchmark("math500")
    assert "\n" not in str(e.value)


def test_hub_offline_reads_hf_hub_offline_and_probes_the_hubs_host(monkeypatch):
    probed = []

    def connect(address, timeout):
        probed.append((address, timeout))
        raise OSError("no route")

    monkeypatch.setattr("common.tasks.socket.create_connection", connect)
    for var in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert hub_offline() and probed == [(("huggingface.co", 443), 3.0)]
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    assert hub_offline(0.5) and probed[-1] == (("mirror.example", 8080), 0.5)
    monkeypatch.setattr("common.tasks.socket.create_connection", lambda address, timeout: socket.socket())
    assert not hub_offline()  # it took the connection
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_offline()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("common.tasks.socket.create_connection", connect)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not hub_offline()  # behind a proxy the direct probe says nothing


def test_an_offline_hub_fails_at_once_with_one_line(monkeypatch):
    """Offline, the dataset loads from the cache or not at all, without the hub client's retries (about 25 s of
    "Retrying in 8s" lines) and without touching the network."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr("common.tasks.hub_offline", lambda: True)

    def no_network(*a, **k):
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(SystemExit) as e:
        load_rows("gsm8k", ("asyncrl-test/no-such-dataset", "main", "test"), None, "--eval-data-path")
    assert str(e.value) == (
        "could not load gsm8k from the hub (asyncrl-test/no-such-dataset, split test: offline, and no cached copy); "
        "pass --eval-data-path <a local json/jsonl/parquet copy> instead."
    )
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before  # put back


def test_a_train_file_next_to_a_test_file_supplies_the_eval_set():
    task = make_task("gsm8k", data_path=str(FIXTURES / "gsm8k" / "train.jsonl"))
    assert task.info["eval_source"] == str(FIXTURES / "gsm8k" / "test.jsonl") and len(task.eval_rows) == 3
    assert task.info["train_size"] == 4


def test_quiet_reload_logs_drops_only_the_expected_vllm_lines():
    import logging

    from common.vllm_engine import quiet_reload_logs

    quiet_reload_logs()
    quiet_reload_logs()  # idempotent: one filter
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert len([f for f in layerwise.filters if getattr(f, "asyncrl", False)]) == 1

    def make(msg, *a):
        return logging.LogRecord(layerwise.name, logging.WARNING, __file__, 1, msg, a, None)

    assert not layerwise.filter(make("%s: Failed to load weights", "ParallelLMHead"))
    assert not layerwise.filter(make("%s: Failed to load weights", "RotaryEmbedding"))
    assert layerwise.filter(make("%s: Failed to load weights", "QKVParallelLinear"))  # a real failure still warns
    assert logging.getLogger("vllm.model_executor.model_loader.reload.inplace").level == logging.WARNING


def test_weight_payload_copies_every_parameter_in_the_engine_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    payload = weight_payload(model, torch.bfloat16)
    assert [n for n, _ in payload] == [n for n, _ in model.named_parameters()]
    for (_, t), p in zip(payload, model.parameters()):
        assert t.dtype == torch.bfloat16 and torch.equal(t, p.detach().to(torch.bfloat16)) and not t.requires_grad
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a copy: later trainer updates do not reach a payload in flight
    assert not torch.equal(payload[0][1], model[0].weight.detach().to(torch.bfloat16))
    same = weight_payload(model, torch.float32)  # same dtype: still a copy
    assert same[0][1].data_ptr() != model[0].weight.data_ptr()


def test_sampling_logprobs_top_p_one_keeps_the_whole_vocabulary():
    # top_p = 1.0 is plain softmax(logits / T): no nucleus cut. On a 49152-entry vocabulary the float32 cumulative
    # sum of the sorted probabilities reaches 1 before the tail, so a cut at mass >= 1 would drop ~1.5-2k tokens.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 49152, generator=g) * 3.0
    lp = sampling_logprobs(logits, 1.0, 1.0)
    assert torch.isfinite(lp).all()
    assert torch.equal(lp, torch.log_softmax(logits / 1.0, dim=-1))
    lp = sampling_logprobs(logits, 0.7, 1.0)
    assert torch.isfinite(lp).all()
    assert torch.equal(lp, torch.log_softmax(logits / 0.7, dim=-1))
