"""Seconds per GRPO update on the default model: generation, trainer step and weight sync, with a roofline.

    python reproduce/speed/benchmark_update.py            # 8 prompts x 8 samples x 16 new tokens

Prints median timings over --repeats measured updates (after one warm-up) and the bf16-matmul floor.
"""

import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import tyro

from common.drift import drift_metrics
from common.engine import HFEngine
from common.logprobs import collate, pad_float, response_logprobs
from common.memory import release_free_memory
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task


@dataclass
class Args:
    model: str = "default"
    """model folder, hub id or 'default'"""
    prompts: int = 8
    """prompts per batch"""
    group_size: int = 8
    """samples per prompt"""
    max_new_tokens: int = 16
    """new tokens per sample (generation runs to this length: EOS is ignored for a fixed workload)"""
    micro_batch_size: int = 32
    """sequences per forward/backward (gradient accumulation, as grpo.py --micro-batch-size)"""
    repeats: int = 3
    """measured updates (after one warm-up)"""
    attn_implementation: str = "sdpa"
    """the trainer's attention kernel, as the scripts' --attn-implementation (sdpa or eager)"""
    gflops: float = 330.0
    """assumed bf16 matmul throughput of this machine for the roofline (GFLOP/s)"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    path = resolve_model(args.model)
    tok, policy = load_tokenizer(path), load_model(path, args.attn_implementation)
    engine = HFEngine(policy, eos_ids=[-1], pad_id=tok.pad_token_id)  # no EOS: every sample has full length
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    task = make_task("arithmetic", eval_size=10)
    n_params = sum(p.numel() for p in policy.parameters())
    rows = {"generate": [], "train_step": [], "diagnostics": [], "weight_sync": [], "heap_trim": []}
    for rep in range(args.repeats + 1):
        prompts = [encode_prompt(tok, task.prompt(r)) for r in task.train_rows(rep, args.prompts)]
        t0 = time.perf_counter()
        outs = engine.generate(
            prompts, n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=0.7, seed=rep
        )
        t1 = time.perf_counter()
        B = len(outs)
        opt.zero_grad()
        per_tok = {"logp": [], "behav": [], "seq": []}  # per response token, as the scripts collect them
        for i in range(0, B, args.micro_batch_size):  # micro-batches of whole groups, as grpo.py forms them
            sub = outs[i : i + args.micro_batch_size]
            batch = collate(
                [prompts[j // args.group_size] for j in range(i, i + len(sub))],
                [o["response"] for o in sub],
                tok.pad_token_id,
            )
            behav = pad_float([o["logprobs"] for o in sub], batch["response_mask"].shape[1])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = response_logprobs(policy, batch, 0.7)
                loss = -(torch.exp(logp - behav) * batch["response_mask"]).sum() / (B * args.max_new_tokens)
            loss.backward()
            mask = batch["response_mask"]
            per_tok["logp"].append(logp.detach()[mask])
            per_tok["behav"].append(behav[mask])
            per_tok["seq"].append(torch.arange(i, i + len(sub))[:, None].expand_as(mask)[mask])
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        t2 = time.perf_counter()
        per_tok = {
            k: torch.cat(v) for k, v in per_tok.items()
        }  # the drift diagnostics every script logs (common/drift.py)
        drift_metrics(per_tok["logp"], per_tok["behav"], per_tok["seq"], None, fresh=True)
        t2b = time.perf_counter()
        engine.load_weights([(n, p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters()], rep + 1)
        t3 = time.perf_counter()
        release_free_memory()  # as the algorithm scripts do after every update
        t4 = time.perf_counter()
        if rep:  # the first round is a warm-up
            for k, v in zip(rows, (t1 - t0, t2 - t1, t2b - t2, t3 - t2b, t4 - t3)):
                rows[k].append(v)
    prompt_tokens = sum(len(p) for p in prompts) * args.group_size
    gen_tokens = args.prompts * args.group_size * args.max_new_tokens
    train_tokens = sum(len(p) for p in prompts) * args.group_size + gen_tokens
    floor_gen = 2 * n_params * (prompt_tokens / args.group_size + gen_tokens) / (args.gflops * 1e9)
    computed_tokens = prompt_tokens // args.group_size + gen_tokens  # each group's prompt runs once
    floor_train = 6 * n_params * computed_tokens / (args.gflops * 1e9)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"model {path} ({n_params / 1e6:.1f}M params), {args.prompts} prompts x {args.group_size} samples x "
        f"{args.max_new_tokens} new tokens, micro-batch {args.micro_batch_size}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"generate     {med['generate']:6.2f} s   {gen_tokens / med['generate']:7.1f} new tokens/s   "
        f"(floor {floor_gen:.2f} s: 2*N*(prefill {prompt_tokens // args.group_size} + decode {gen_tokens}) tokens)"
    )
    print(
        f"train step   {med['train_step']:6.2f} s   {train_tokens / med['train_step']:7.1f} tokens/s   "
        f"(floor {floor_train:.2f} s: 6*N*(prompts {prompt_tokens // args.group_size} + responses {gen_tokens}) "
        f"tokens; {train_tokens} without prompt sharing)"
    )
    print(f"diagnostics  {med['diagnostics']:6.4f} s (async/ess, ess_seq, log_ratio_m2, mismatch_kl: common/drift.py)")
    print(f"weight sync  {med['weight_sync']:6.2f} s")
    print(f"heap trim    {med['heap_trim']:6.2f} s   (freed memory back to the OS, common/memory.py)")
    total = sum(med.values())
    print(
        f"update total {total:6.2f} s   (roofline floor {floor_gen + floor_train:.2f} s at {args.gflops:.0f} GFLOP/s)"
    )
