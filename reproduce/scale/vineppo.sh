#!/usr/bin/env bash
# VinePPO, arXiv 2410.01679, GSM8K setting (official configs polIter_*_vineppo_GSM8K): DeepSeekMath-7B SFTed on GSM8K
# (realtreetune/deepseekmath-7b-sft-GSM8K; the paper's small model, realtreetune/rho-1b-sft-GSM8K, in colocated mode)
# with the vineppo prompt ("[MATH_TASK] Problem: ... Solution:", raw text, answer after "####"), 64 prompts x 8
# samples per iteration, K = 9 Monte Carlo completions per step state, up to 25 valued states per response (the GSM8K
# cap), 2 epochs of 8 updates (minibatches of 64 samples), PPO clip 0.2, k3 KL loss 1e-4, a batch whose mean ratio
# exceeds 10 skipped, advantages whitened over the batch, lr 1e-6 with a 3% warm-up, temperature 0.6, 1024 new
# tokens, 650 iterations (10400 updates); synchronous (staleness 0); GSM8K test set.
# Run: bash reproduce/scale/vineppo.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# Not the paper's: top-p 1.0 instead of 0.9 (the ratio's denominator is the engine's log-prob, which the trainer cannot
# reproduce under top-p; the official trainer recomputes the old log-probs itself); the learning rate stays constant
# after the warm-up (our only schedule); steps are split on newlines (the paper's GSM8K choice; MATH would need its
# LaTeX-aware splitter, and the "####" verifier refuses MATH answers anyway). node / nodes train on 66 / 70 prompts per
# iteration instead of 64 (below).
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" vineppo "$@"
SCRIPT=${SCRIPT:-algorithms/vineppo.py}
COMMON=(--model realtreetune/deepseekmath-7b-sft-GSM8K --task gsm8k --eval-task gsm8k --prompt-template vineppo
        --prompts-per-batch 64 --group-size 8 --updates-per-batch 8 --epochs 2 --staleness 0 --value-estimator mc
        --mc-samples 9 --max-steps 25 --clip-eps 0.2 --kl-coef 1e-4 --ratio-guard 10 --whiten-advantages
        --max-new-tokens 1024 --temperature 0.6 --top-p 1.0 --learning-rate 1e-6 --warmup-updates 312
        --total-updates 10400 --eval-every 160 --eval-size 0 --checkpoint-every 160 --micro-batch-size 1)
# Micro-batches: a minibatch of P x 8 / 8 = P samples makes P micro-batches of 1: 64 splits over neither 6 nor 14
# ranks; 66 = 6 x 11 (+3%) and 70 = 14 x 5 (+9%) are the nearest that do (those below, 60 and 56, are farther).
# Colocated (one rank) uses micro-batches of 8.
COLOCATED=(--model realtreetune/rho-1b-sft-GSM8K --micro-batch-size 8)
NODE=(--prompts-per-batch 66)
NODES=(--prompts-per-batch 70)
