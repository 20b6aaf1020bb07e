#!/usr/bin/env bash
# GRPO, arXiv 2402.03300 (DeepSeekMath, sec. 4.2): RL from DeepSeekMath-Instruct 7B, 64 samples per question, 1024
# samples per batch (16 prompts), max length 1024, lr 1e-6, KL coefficient 0.04 (k3, as the paper's estimator), one
# update per batch (on-policy: staleness 0), clip 0.2, the paper's per-sequence loss (seq-mean-token-mean), group
# z-score advantages; GSM8K with algorithms.md's GRPO prompt ("####", verl's GSM8K recipe) and the GSM8K test set.
# Run: bash reproduce/scale/grpo.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# Not the paper's: its RL data were ~144K GSM8K- and MATH-style questions from its SFT data, rewarded by a learned
# reward model, with its own CoT prompt; here the GSM8K train set, the rule-based "####" verifier (1/0) and
# algorithms.md's prompt (--task math --eval-task math500 --prompt-template m2po for MATH). Temperature 1.0 is
# algorithms.md's typical setting (the paper states none); 500 updates is ours. node / nodes train on 15 / 14 prompts
# (960 / 896 samples) per batch instead of 16 (below); colocated trains Qwen2.5-1.5B-Instruct (DeepSeekMath has no
# smaller sibling; the 7B's trainer state alone is ~112 GiB). An async run: add --staleness S.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" grpo "$@"
SCRIPT=${SCRIPT:-algorithms/grpo.py}
COMMON=(--model deepseek-ai/deepseek-math-7b-instruct --task gsm8k --eval-task gsm8k --prompt-template grpo
        --prompts-per-batch 16 --group-size 64 --updates-per-batch 1 --staleness 0 --max-new-tokens 1024
        --temperature 1.0 --learning-rate 1e-6 --kl-coef 0.04 --clip-eps 0.2 --loss-agg seq-mean-token-mean
        --total-updates 500 --eval-every 50 --eval-size 0 --checkpoint-every 50 --micro-batch-size 8)
# Micro-batches: a minibatch of P x 64 samples makes 8P micro-batches of 8, a multiple of 6 only when 3 divides P and
# of 14 only when 7 does: 16 prompts (128) fit neither; 15 prompts make 120 = 6 x 20, 14 prompts 112 = 14 x 8.
COLOCATED=(--model Qwen/Qwen2.5-1.5B-Instruct)
NODE=(--prompts-per-batch 15)
NODES=(--prompts-per-batch 14)
