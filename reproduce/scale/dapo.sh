#!/usr/bin/env bash
# DAPO, arXiv 2503.14476: Qwen2.5-32B (base) on DAPO-Math-17k with the DAPO prompt ("Answer:" line, +1/-1 reward),
# 512 prompts x 16 samples per batch, 16 updates per batch (minibatches of 32 prompts), 20480 new tokens (L_max) with
# a 4096-token overlong buffer (L_cache, soft punishment on, overlong filtering off as in the final recipe),
# clip-higher 0.2 / 0.28, dynamic sampling (3x prompts per round, at most 10 rounds), token-level loss, no KL,
# lr 1e-6 with a 20-step warm-up, temperature 1.0; AIME 2024 for the evaluation. The paper is synchronous
# (staleness 0: later minibatches of a batch are up to 15 updates stale, as there).
# Run: bash reproduce/scale/dapo.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# Not the paper's: the warm-up counts optimizer updates here, so 20 rollout steps = 320 updates; the evaluation is
# greedy (the paper: avg@32 at temperature 1.0, top-p 0.7: reproduce/eval/evaluate.py --n 32 --temperature 1.0 --top-p
# 0.7 on a checkpoint); 16000 updates (1000 batches) is ours. node / nodes train on 510 / 518 prompts per batch instead
# of 512 (below); colocated trains Qwen2.5-1.5B (the 32B does not fit one GPU). Memory: the 32B's fp32 weights + AdamW
# state are ~512 GiB, ~85 GiB per rank on one node (H200-class GPUs), ~37 GiB on two; the trainer has no activation
# checkpointing, so a 20k-token sample's activations may still not fit one GPU (not run on GPUs yet:
# docs/distributed.md, "Not yet run on GPUs").
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" dapo "$@"
SCRIPT=${SCRIPT:-algorithms/dapo.py}
COMMON=(--model Qwen/Qwen2.5-32B --task dapo17k --eval-task aime24 --prompt-template dapo
        --prompts-per-batch 512 --group-size 16 --updates-per-batch 16 --staleness 0 --max-new-tokens 20480
        --overlong-shaping --overlong-buffer 4096 --no-overlong-filtering --clip-higher --clip-eps-low 0.2
        --clip-eps-high 0.28 --dynamic-sampling --oversample 3 --max-sampling-rounds 10 --token-level-loss
        --kl-coef 0 --temperature 1.0 --top-p 1.0 --learning-rate 1e-6 --warmup-updates 320
        --total-updates 16000 --eval-every 80 --eval-size 0 --checkpoint-every 80 --micro-batch-size 1)
# Micro-batches: a minibatch of P x 16 / 16 = P samples makes P micro-batches of 1 (20k-token samples): 512 is a
# multiple of neither 6 nor 14; 510 = 6 x 85 (-0.4%) and 518 = 14 x 37 (+1.2%) are the nearest that are.
COLOCATED=(--model Qwen/Qwen2.5-1.5B)
NODE=(--prompts-per-batch 510)
NODES=(--prompts-per-batch 518)
