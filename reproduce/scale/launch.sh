#!/usr/bin/env bash
# Launch an asyncrl script on GPUs: one GPU (colocated), one node (vLLM on its own GPUs) or several nodes.
# docs/distributed.md explains the layout; README "Scaling out" lists the memory knobs.
#
#   bash reproduce/scale/launch.sh colocated            # 1 GPU: trainer and vLLM share it
#   bash reproduce/scale/launch.sh node                 # 1 node x 8 GPUs: 6 trainer ranks (FSDP2), vLLM TP=2 on GPUs 6-7
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash reproduce/scale/launch.sh nodes   # on node 0 (6 trainer ranks + vLLM on 2 GPUs)
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash reproduce/scale/launch.sh nodes   # on node 1 (8 trainer ranks)
#
# Several nodes: MASTER_ADDR:MASTER_PORT (default 29500) on node 0 must be reachable from every node (torchrun's
# rendezvous, then NCCL between trainer ranks, on ports NCCL picks: allow traffic between the nodes). The engine and
# its NCCL weight transfer (127.0.0.1:29555) stay on node 0, beside rank 0. The run folder (runs/) must be on a file
# system every node sees, for --resume. Extra arguments go to the script, e.g. --total-updates 10 for a smoke run.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?"usage: launch.sh colocated|node|nodes [script flags]"}; shift
SCRIPT=${SCRIPT:-algorithms/m2po.py}
RUN=${DRY_RUN:+echo}  # DRY_RUN=1: print the command instead of running it (the tests parse its flags)
# M2PO's setting (arXiv 2510.01161, official staleness simulation): Qwen2.5-Math-7B on DeepScaleR at staleness 256,
# 256 prompts x 8 samples per rollout batch, 4 updates per batch, lr 1e-6, temperature 1.0, MATH-500 for the greedy
# evaluation; 3072 new tokens leave room for the prompt in Qwen2.5-Math's 4096-token context.
# Micro-batches: each update's minibatch (prompts x 8 / 4 samples) is cut into micro-batches of --micro-batch-size,
# whose number must be a multiple of the trainer ranks (the scripts refuse to start otherwise).
COMMON=(--model Qwen/Qwen2.5-Math-7B --task deepscaler --eval-task math500 --prompt-template m2po --engine vllm
        --prompts-per-batch 256 --group-size 8 --updates-per-batch 4 --staleness 256 --max-new-tokens 3072
        --temperature 1.0 --learning-rate 1e-6 --eval-every 50 --eval-size 500 --checkpoint-every 50
        --gen-batch-size 512 --logprob-chunk-tokens 4096 --micro-batch-size 4)
case "$MODE" in
  colocated)  # one process, vLLM in it on the same GPU: the 1.5B model (the 7B's trainer state alone is ~112 GiB)
    $RUN python "$SCRIPT" "${COMMON[@]}" --model Qwen/Qwen2.5-Math-1.5B --vllm-kv-cache-gib 16 "$@" ;;
  node)  # 6 trainer ranks (FSDP2) + vLLM TP=2 on GPUs 6-7; 192 prompts: 384 samples per update = 96 micro-batches
    $RUN torchrun --standalone --nproc-per-node 6 "$SCRIPT" "${COMMON[@]}" --prompts-per-batch 192 --vllm-gpus 2 \
      --vllm-kv-cache-gib 40 "$@" ;;
  nodes)  # 2 nodes: 6 + 8 = 14 trainer ranks, the engine on node 0's GPUs 6-7; 224 prompts: 112 micro-batches
    NPROC=$([ "${NODE_RANK:?set NODE_RANK}" = 0 ] && echo 6 || echo 8)
    $RUN torchrun --nnodes 2 --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:?}" \
      --master-port "${MASTER_PORT:-29500}" "$SCRIPT" "${COMMON[@]}" --prompts-per-batch 224 --vllm-gpus 2 \
      --vllm-kv-cache-gib 40 "$@" ;;
  *) echo "unknown mode $MODE: colocated, node or nodes" >&2; exit 2 ;;
esac
