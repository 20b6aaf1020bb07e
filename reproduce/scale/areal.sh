#!/usr/bin/env bash
# AReaL decoupled PPO (ppo_stale.py), arXiv 2505.24298, math runs: DeepSeek-R1-Distill-Qwen-7B (the staleness ablation:
# 1.5B) on DeepScaleR, 512 prompts x 16 samples per batch, 4 PPO minibatches (updates) per batch, 27648 new tokens, lr
# 2e-5 (constant, 0.1% warm-up), temperature 1.0, no KL, no critic (gamma = lambda = 1), advantages whitened over the
# batch, decoupled loss with clip 0.2 and behaviour-weight cap 5, bounded staleness eta = 4 (--max-staleness, AReaL's
# max_head_offpolicyness: rollout batches the producer may run ahead; the largest eta with no loss in the paper's
# ablation, AIME24 42.2 vs 42.0 at eta = 0); 1000 PPO steps; AIME 2024 for the evaluation.
# Run: bash reproduce/scale/areal.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# Not the paper's: reward 1/0 instead of +-5 (the batch whitening removes the scale); AdamW eps 1e-8 (torch's default;
# AReaL 1e-5, no flag here); the m2po prompt (\boxed{} + math_verify) rather than AReaL's own; greedy evaluation (the
# paper: avg@32); one vLLM engine, whose new weights land between its calls of --gen-batch-size sequences, not
# mid-generation (interruptible generation is HF-only: docs/engines.md), instead of many interruptible inference
# servers. Bounded mode is not deterministic. node / nodes train on 513 / 511 prompts per batch instead of 512 (below);
# colocated trains the paper's 1.5B. Memory: the trainer has no activation checkpointing, so a 27k-token sample's
# activations may not fit one GPU (not run on GPUs yet).
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" areal "$@"
SCRIPT=${SCRIPT:-algorithms/ppo_stale.py}
COMMON=(--model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --task deepscaler --eval-task aime24 --prompt-template m2po
        --prompts-per-batch 512 --group-size 16 --updates-per-batch 4 --max-staleness 4 --max-new-tokens 27648
        --decoupled --clip-eps 0.2 --behav-weight-cap 5 --adv-norm batch --kl-coef 0 --temperature 1.0 --top-p 1.0
        --learning-rate 2e-5 --warmup-updates 4 --total-updates 4000
        --eval-every 40 --eval-size 0 --checkpoint-every 40 --micro-batch-size 1)
# Micro-batches: a minibatch of P x 16 / 4 = 4P samples makes 4P micro-batches of 1 (27k-token samples), a multiple
# of 6 when 3 divides P and of 14 when 7 does: 512 fits neither; 513 = 3 x 171 (+0.2%), 511 = 7 x 73 (-0.2%).
COLOCATED=(--model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B)
NODE=(--prompts-per-batch 513)
NODES=(--prompts-per-batch 511)
