"""Greedy evaluation of the trained policy on the held-out problems, split over the trainer ranks."""

import numpy as np
import torch
import torch.distributed as dist

from common.distributed import is_sharded, merge_ranks
from common.engine import sample


@torch.no_grad()
def greedy_eval(
    policy, tokenizer, prompts: list[list[int]], rows: list, reward, *, eos_ids, max_new_tokens, batch_size, autocast
) -> dict:
    """Greedy decoding of every held-out prompt with the trainer's weights, scored by ``reward(text, row)``.

    Rank r of R takes the r-th contiguous share of the problems and decodes it ``batch_size`` prompts at a time (the
    KV cache of one batch is what evaluation adds to the trainer's memory). A policy sharded over the ranks stays
    sharded: the ranks decode in lockstep (``sample``), each step gathering one block's weights at a time as training
    does, so no rank holds the full model; a rank whose share ends first decodes copies of its last prompt (results
    dropped) until every rank is through. Returns ``eval/accuracy`` (share with reward 1), ``eval/truncated_frac``
    (share that hit ``max_new_tokens``) and ``eval/response_length_mean`` (tokens), over all problems and every
    rank's share. Leaves the policy in train mode.
    """
    if batch_size < 1:
        raise SystemExit(f"--eval-batch-size must be >= 1, got {batch_size}")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    lo, hi = rank * len(prompts) // world, (rank + 1) * len(prompts) // world  # this rank's problems
    most = -(-len(prompts) // world)  # the largest share: the number of passes of every rank in lockstep
    passes = -(-(most if is_sharded(policy) else hi - lo) // batch_size)
    policy.eval()
    responses, truncated = [], []
    for j in range(passes):
        mine = prompts[lo + j * batch_size : min(lo + (j + 1) * batch_size, hi)]
        r, _, tr = sample(
            policy,
            mine or prompts[-1:],  # lockstep: a pass with nothing left of this rank's share still takes part
            eos_ids=eos_ids,
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_token_id,
            greedy=True,
            autocast=autocast,
        )
        responses += r[: len(mine)]
        truncated += tr[: len(mine)]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    correct = [reward(t, row) == 1.0 for t, row in zip(texts, rows[lo:hi], strict=True)]
    correct, truncated, lengths = merge_ranks(correct, truncated, [len(r) for r in responses])
    policy.train()
    return {
        "eval/accuracy": float(np.mean(correct)),
        "eval/truncated_frac": float(np.mean(truncated)),
        "eval/response_length_mean": float(np.mean(lengths)),
    }
