#!/usr/bin/env bash
# DPPO, arXiv 2602.04879, with the authors' recipe (verl PR #5397, examples/dppo_trainer/run_qwen30b_dppo.sh):
# Qwen3-30B-A3B-Base on DAPO-Math-17k with the DAPO prompt, 256 prompts x 16 samples per rollout batch, 8 updates per
# batch (minibatches of 32 prompts), 8192 new tokens, DPPO-Binary-TV with delta 0.15 (--divergence kl: delta 0.05)
# anchored on the rollout engine's log-probs, no ratio cap, Dr. GRPO advantages (no std) and seq-mean-token-sum-norm
# aggregation, no KL, lr 1e-6, temperature 1.0; AIME 2024 for the evaluation. The recipe is synchronous (staleness 0:
# later minibatches of a batch are up to 7 updates stale, as there); --staleness s after the mode runs it stale.
# Run: bash reproduce/scale/dppo.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# DPPO-Binary-KL: bash reproduce/scale/dppo.sh node --divergence kl
# Not the paper's: the paper filters DAPO-Math to ~13k problems (the full set here) and reports avg@32 on AIME24/25
# (greedy here: reproduce/eval/evaluate.py --n 32 --temperature 1.0 on a checkpoint); 4000 updates (500 rollout
# batches, the recipe's total_training_steps) with an evaluation every 80 (its test_freq of 10 batches); node / nodes
# train on 255 / 259 prompts per batch instead of 256 (below); colocated trains Qwen3-1.7B-Base (the model of the
# paper's section 6). Memory: the recipe runs Megatron with expert parallelism and offloaded weights, gradients and
# optimizer state; here FSDP2 holds the 30.5B's fp32 weights + AdamW state (~450 GiB): ~76 GiB per rank on one node
# (H200-class GPUs), ~33 GiB on two (not run on GPUs yet: docs/distributed.md, "Not yet run on GPUs").
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" dppo "$@"
SCRIPT=${SCRIPT:-algorithms/dppo.py}
COMMON=(--model Qwen/Qwen3-30B-A3B-Base --task dapo17k --eval-task aime24 --prompt-template dapo
        --prompts-per-batch 256 --group-size 16 --updates-per-batch 8 --staleness 0 --max-new-tokens 8192
        --divergence tv --delta-tv 0.15 --delta-kl 0.05 --ratio-cap None --no-scale-std
        --loss-agg seq-mean-token-sum-norm --kl-coef 0 --temperature 1.0 --top-p 1.0 --learning-rate 1e-6
        --total-updates 4000 --eval-every 80 --eval-size 0 --checkpoint-every 80 --micro-batch-size 1)
# Micro-batches: a minibatch of P x 16 / 8 = 2P samples makes 2P micro-batches of 1 (8k-token samples): 512 is a
# multiple of neither 6 nor 14; 255 prompts (510 = 6 x 85, -0.4%) and 259 (518 = 14 x 37, +1.2%) are the nearest.
COLOCATED=(--model Qwen/Qwen3-1.7B-Base)
NODE=(--prompts-per-batch 255)
NODES=(--prompts-per-batch 259)
