"""Generation throughput of the HF and vLLM rollout engines on the same batch, and their weight-sync time.

    python reproduce/speed/benchmark_engines.py                # default model, 64 prompts x 64 new tokens, both engines
    python reproduce/speed/benchmark_engines.py --engines hf   # without vLLM installed

Every sample runs to --max-new-tokens (no EOS), so both engines do the same work. Prints, per engine, the start-up
time, the median over --repeats measured batches (after one warm-up batch) of the generation time and tokens/s,
and the median time of a weight sync (the trainer's fp32 weights cast to the engine's dtype, then loaded).
"""

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import tyro

from common.engine import make_engine, weight_payload
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task


@dataclass
class Args:
    model: str = "default"
    """model folder, hub id or 'default'"""
    engines: list[Literal["hf", "vllm"]] = field(default_factory=lambda: ["hf", "vllm"])
    """engines to measure, in this order (one vLLM engine per process, so vLLM goes last)"""
    prompts: int = 64
    """distinct prompts per batch (the default task's questions)"""
    group_size: int = 1
    """samples per prompt"""
    max_new_tokens: int = 64
    """new tokens per sample (EOS ignored: a fixed workload)"""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """the engines' weight dtype"""
    repeats: int = 3
    """measured batches and syncs per engine (after one warm-up batch)"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    path = resolve_model(args.model)
    tok, policy = load_tokenizer(path), load_model(path)
    dtype = getattr(torch, args.dtype)
    task = make_task("arithmetic", eval_size=10)
    batches = [
        [encode_prompt(tok, task.prompt(r)) for r in task.train_rows(i, args.prompts)] for i in range(args.repeats + 1)
    ]
    prompt_tokens = statistics.mean(len(p) for b in batches for p in b)
    print(
        f"{path}: {args.prompts} prompts x {args.group_size} samples x {args.max_new_tokens} new tokens "
        f"(prompts {prompt_tokens:.0f} tokens on average), {args.dtype}, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results = []
    for kind in args.engines:
        t0 = time.perf_counter()
        engine = make_engine(
            kind,
            policy,
            path,
            eos_ids=[],
            pad_id=tok.pad_token_id,
            dtype=dtype,
            max_batch=args.prompts * args.group_size,
            seed=0,
        )
        start = time.perf_counter() - t0
        gen, tps = [], []
        for i, prompts in enumerate(batches):
            t0 = time.perf_counter()
            outs = engine.generate(
                prompts, n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=0.7, seed=i
            )
            seconds = time.perf_counter() - t0
            tokens = sum(len(o["response"]) for o in outs)
            assert tokens == args.prompts * args.group_size * args.max_new_tokens, (
                "every sample must run to full length"
            )
            if i > 0:  # batch 0 is the warm-up
                gen.append(seconds)
                tps.append(tokens / seconds)
        cast, load = [], []
        for v in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            payload = weight_payload(policy, dtype)
            t1 = time.perf_counter()
            engine.load_weights(payload, v)
            load.append(time.perf_counter() - t1)
            cast.append(t1 - t0)
        row = dict(
            engine=kind,
            start_s=start,
            generate_s=statistics.median(gen),
            tokens_per_s=statistics.median(tps),
            sync_cast_s=statistics.median(cast),
            sync_load_s=statistics.median(load),
        )
        results.append(row)
        print(
            f"{kind}: start {row['start_s']:.1f}s | generate {row['generate_s']:.2f}s = {row['tokens_per_s']:.0f} "
            f"tokens/s | weight sync: cast {row['sync_cast_s']:.3f}s + load {row['sync_load_s']:.3f}s",
            flush=True,
        )
        del engine
    print(f"\n{'engine':<8}{'start s':>9}{'generate s':>12}{'tokens/s':>10}{'sync s (cast + load)':>24}")
    for r in results:
        print(
            f"{r['engine']:<8}{r['start_s']:>9.1f}{r['generate_s']:>12.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['sync_cast_s'] + r['sync_load_s']:>15.3f} ({r['sync_cast_s']:.3f} + {r['sync_load_s']:.3f})"
        )
