#!/usr/bin/env bash
# TBA, arXiv 2503.18929, GSM8K setting: the SFTed RhoMath-1B (VinePPO's realtreetune/rho-1b-sft-GSM8K) on GSM8K with
# the tba prompt ("[MATH TASK] Problem: ... Solution:", raw text, reward 1/0 on the last number), K = 20 samples per
# prompt, 7 prompts per update, lr 1e-5, temperature 0.7, 512 new tokens, beta 0.014 -> 0.004 over 500 updates,
# weights to the searcher every k = 2 updates (--staleness), recency draws with probability m = 0.95, 100 newest
# de-duplicated samples per prompt, the searcher generating continuously (--free-running --rounds-ahead -1); GSM8K
# test set.
# Run: bash reproduce/scale/tba.sh colocated|node|nodes [flags]   (launcher, two-node setup: launch.sh)
# Not the paper's: one searcher (one vLLM engine, tensor-parallel on node / nodes) instead of several searcher GPUs;
# the reward-prioritised draws' inverse temperature (--priority-inv-temp 1) is unverified (docs/tba.md); node / nodes
# train on 6 / 14 prompts per update instead of 7 (below). The 1.1B model fits one GPU: every mode trains it.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && exec bash "$(dirname "$0")/launch.sh" tba "$@"
SCRIPT=${SCRIPT:-algorithms/tba.py}
COMMON=(--model realtreetune/rho-1b-sft-GSM8K --task gsm8k --eval-task gsm8k --prompt-template tba
        --prompts-per-batch 7 --group-size 20 --staleness 2 --recency-prob 0.95 --buffer-capacity 100
        --free-running --rounds-ahead -1 --max-new-tokens 512 --temperature 0.7 --learning-rate 1e-5
        --beta-start 0.014 --beta-end 0.004 --beta-anneal-updates 500 --total-updates 500
        --eval-every 50 --eval-size 0 --checkpoint-every 50 --micro-batch-size 20)
# Micro-batches: tba.py packs whole prompt slots (<= K = 20 samples, so that log Z is exact) into micro-batches, here
# one slot per micro-batch of 20, P micro-batches per update: 7 splits over neither 6 nor 14 ranks (nor does any
# larger --micro-batch-size), so one node trains 6 prompts per update (-14%) and two nodes 14 (2x).
COLOCATED=()
NODE=(--prompts-per-batch 6)
NODES=(--prompts-per-batch 14)
