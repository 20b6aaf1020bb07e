#!/usr/bin/env bash
# M2PO, arXiv 2510.01161 (official staleness simulation): Qwen2.5-Math-7B on DeepScaleR at staleness s = 256 updates,
# 256 prompts x 8 samples per rollout batch, 4 updates per batch (s = 4k: a FIFO of k = 64 batches, the first 256
# updates on base-model rollouts), tau = 0.04, lr 1e-6, temperature 1.0, no KL, token-mean, m2po prompt (\boxed{} +
# math_verify), MATH-500 for the evaluation.
# Run: bash reproduce/scale/m2po.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# GRPO-at-s=256 baseline of the paper, same flags: SCRIPT=algorithms/grpo.py bash reproduce/scale/m2po.sh node
# (--tau is left at m2po.py's default 0.04 for that reason: grpo.py has no such flag).
# Not the paper's / not in algorithms.md: 3072 new tokens (room for the prompt in Qwen2.5-Math's 4096-token context);
# 1024 updates (the run length is ours); greedy MATH-500 evaluation only (the paper also reports AMC, AIME, Minerva,
# OlympiadBench: --eval-task); node / nodes train on 252 prompts per batch instead of 256 (below); colocated trains
# Qwen2.5-Math-1.5B (the 7B's fp32 weights + AdamW state alone are ~112 GiB).
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" m2po "$@"
SCRIPT=${SCRIPT:-algorithms/m2po.py}
COMMON=(--model Qwen/Qwen2.5-Math-7B --task deepscaler --eval-task math500 --prompt-template m2po
        --prompts-per-batch 256 --group-size 8 --updates-per-batch 4 --staleness 256 --max-new-tokens 3072
        --temperature 1.0 --learning-rate 1e-6 --kl-coef 0 --total-updates 1024
        --eval-every 50 --eval-size 500 --checkpoint-every 50 --micro-batch-size 4)
# Micro-batches: a minibatch of P x 8 / 4 = 2P samples makes P / 2 micro-batches of 4. 256 prompts make 128, which
# neither 6 nor 14 ranks divide; 252 prompts make 126 = 6 x 21 = 14 x 9 (-1.6% samples per batch).
COLOCATED=(--model Qwen/Qwen2.5-Math-1.5B)
NODE=(--prompts-per-batch 252)
NODES=(--prompts-per-batch 252)
