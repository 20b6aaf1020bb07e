#!/usr/bin/env bash
# Launch a paper's settings on GPUs with the vLLM engine: one GPU (colocated), one node (vLLM on its own GPUs) or
# two nodes. The settings of each paper are in reproduce/scale/<paper>.sh (m2po grpo dapo dppo areal tba vineppo), which
# this file sources; each of those files also runs on its own (bash reproduce/scale/dapo.sh node = bash
# reproduce/scale/launch.sh dapo node). docs/distributed.md explains the layout and lists the memory knobs ("Several
# nodes, and memory") and the papers' settings ("Launches on GPUs: reproduce/scale/"); README "Recipes" links it.
#
#   bash reproduce/scale/launch.sh dapo colocated   # 1 GPU: trainer and vLLM share it
#   bash reproduce/scale/launch.sh dapo node        # 1 node x 8 GPUs: 6 trainer ranks (FSDP2), vLLM TP=2 on GPUs 6-7
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash reproduce/scale/launch.sh dapo nodes   # node 0: 6 trainer ranks + vLLM
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash reproduce/scale/launch.sh dapo nodes   # node 1: 8 trainer ranks
#   bash reproduce/scale/launch.sh node             # no paper named: M2PO (the usage before the other papers)
#
# Several nodes: MASTER_ADDR:MASTER_PORT (default 29500) on node 0 must be reachable from every node (torchrun's
# rendezvous, then NCCL between trainer ranks, on ports NCCL picks: allow traffic between the nodes). The engine and
# its NCCL weight transfer (127.0.0.1, on a free port the OS picks) stay on node 0, beside rank 0. The run folder
# (runs/) must be on a file system every node sees, for --resume. Extra arguments go to the script after the paper's
# flags, so they win: e.g. --total-updates 10 for a smoke run, --staleness 64 for a stale run of a synchronous paper.
# DRY_RUN=1 prints the command instead of running it (tests/test_distributed.py parses it for every paper and mode).
#
# Micro-batches: every rank must run the same number of micro-batches per optimizer update, so that number (each
# update's minibatch cut into micro-batches of --micro-batch-size) must be a multiple of the trainer ranks: 6 on one
# node, 6 + 8 = 14 on two; the scripts refuse to start otherwise. Where the paper's batch does not split that way,
# the paper's file changes --prompts-per-batch per mode to the nearest value that does, and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODES="colocated|node|nodes"
PAPERS="m2po|grpo|dapo|dppo|areal|tba|vineppo"
USAGE="usage: launch.sh [$PAPERS] $MODES [script flags]"
case "${1:-}" in
  colocated|node|nodes) PAPER=m2po ;;  # the original usage, M2PO's settings
  "") echo "$USAGE" >&2; exit 2 ;;
  *) PAPER=$1; shift ;;
esac
[[ "|$PAPERS|" == *"|$PAPER|"* ]] || { echo "unknown paper $PAPER: $PAPERS" >&2; exit 2; }
MODE=${1:?$USAGE}; shift
# The paper's file sets SCRIPT, COMMON (flags of every mode) and COLOCATED / NODE / NODES (flags of one mode, after
# COMMON: the smaller model of the colocated mode, the prompts per batch that split over the ranks).
source "reproduce/scale/$PAPER.sh"
RUN=${DRY_RUN:+echo}
# Engine and memory knobs shared by every paper (a paper's flags may override them): vLLM, sequences per engine
# call, tokens per log-prob chunk; the KV cache per mode below.
ENGINE=(--engine vllm --gen-batch-size 512 --logprob-chunk-tokens 4096)
case "$MODE" in
  colocated)  # one process, vLLM in it on the same GPU (its KV cache is the knob; the trainer gets the rest)
    $RUN python "$SCRIPT" "${ENGINE[@]}" --vllm-kv-cache-gib 16 "${COMMON[@]}" "${COLOCATED[@]}" "$@" ;;
  node)  # 6 trainer ranks (FSDP2) on GPUs 0-5 + vLLM TP=2 on GPUs 6-7, NCCL weight sync
    $RUN torchrun --standalone --nproc-per-node 6 "$SCRIPT" "${ENGINE[@]}" --vllm-gpus 2 --vllm-kv-cache-gib 40 \
      "${COMMON[@]}" "${NODE[@]}" "$@" ;;
  nodes)  # 2 nodes: 6 + 8 = 14 trainer ranks, the engine on node 0's GPUs 6-7
    NPROC=$([ "${NODE_RANK:?set NODE_RANK}" = 0 ] && echo 6 || echo 8)
    $RUN torchrun --nnodes 2 --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:?}" \
      --master-port "${MASTER_PORT:-29500}" "$SCRIPT" "${ENGINE[@]}" --vllm-gpus 2 --vllm-kv-cache-gib 40 \
      "${COMMON[@]}" "${NODES[@]}" "$@" ;;
  *) echo "unknown mode $MODE: colocated, node or nodes" >&2; exit 2 ;;
esac
