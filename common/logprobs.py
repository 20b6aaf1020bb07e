"""The trainer's forward: samples into padded tensors (the layout the HF engine samples with too), and per-token
log-probs of the responses, the prompt shared by a group run once, without the full-vocabulary blow-up."""

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from common.distributed import is_sharded


@contextmanager
def side_autocast(device_type: str, enabled: bool = True):
    """bf16 autocast for a thread that runs beside the trainer (a searcher's reference forward): the casts of
    ``torch.autocast``, but it neither fills nor clears torch's cast cache.

    That cache (one bf16 copy of each fp32 weight per forward) is shared by all threads, and ``torch.autocast`` clears
    it whenever a thread leaves its outermost region. A clear in the middle of the trainer's forward makes the next use
    of a weight cast it again: the weight then gets two cast nodes, whose bf16 gradients reach fp32 separately instead
    of being summed in bf16 first, and the update differs in the last bits depending on when the other thread ran.
    Here the region is counted in the thread's nesting depth (so nested ``torch.autocast(enabled=False)`` regions,
    which transformers' rotary embeddings open, do not clear it either) and left without a clear."""
    if not enabled:
        yield
        return
    prev = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    prev_cache = torch.is_autocast_cache_enabled()  # thread-local, like the enabled flag and the nesting depth
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, torch.bfloat16)
    torch.set_autocast_cache_enabled(False)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled(device_type, prev[0])
        torch.set_autocast_dtype(device_type, prev[1])
        torch.set_autocast_cache_enabled(prev_cache)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention_mask) tensors of shape [B, max_len]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each sequence's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None) -> dict:
    """[left-padded prompt | right-padded response] tensors on ``device`` (default CPU). ``response_mask`` marks
    real response tokens; the response part is at least 2 wide (padding), so every batch takes the same
    forward path in ``response_hidden`` (sharded trainers need the same number of passes on every rank).

    Also the distinct prompts (``unique_ids``/``unique_mask``, left-padded to the same width) and each
    sample's row among them (``prompt_index``), so a group's shared prompt can be run once.
    """
    p_ids, p_mask = left_pad(prompts, pad_id)
    first: dict[tuple, int] = {}
    prompt_index = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts], dtype=torch.long)
    rows = torch.stack([(prompt_index == u).nonzero()[0, 0] for u in range(len(first))])  # first sample of each
    R = max(2, max(len(r) for r in responses))
    r_ids = torch.full((len(responses), R), pad_id, dtype=torch.long)
    r_mask = torch.zeros((len(responses), R), dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        r_mask[i, : len(r)] = 1
    mask = torch.cat([p_mask, r_mask], 1)
    out = dict(
        input_ids=torch.cat([p_ids, r_ids], 1),
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        response_ids=r_ids,
        response_mask=r_mask.bool(),
        prompt_len=p_ids.shape[1],
        unique_ids=p_ids[rows],
        unique_mask=p_mask[rows],
        prompt_index=prompt_index,
    )
    return {k: v.to(device) if torch.is_tensor(v) and device is not None else v for k, v in out.items()}


def pad_float(rows: list[list[float]], width: int, device=None) -> torch.Tensor:
    """Right-pad lists of floats with zeros into a [B, width] float32 tensor (on ``device``, default CPU)."""
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device) if device is not None else out


def _chunk_logp_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = (h @ weight.t()).float() / temperature
    lse = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy


def response_hidden(model, batch: dict, share_prompts: bool = True) -> torch.Tensor:
    """Final hidden states that predict each response token: [B, R, H] (position j predicts response token j).

    With ``share_prompts`` each distinct prompt runs once and its KV cache is gathered for every sample of
    it, then only the response tokens run (same attention as the full sequence: causal, left padding
    masked). For a group of G samples this cuts the prompt's share of the compute (and activations) by G.
    Gradients flow through the gathered cache back into the prompt pass, so they are the full-sequence ones.
    """
    P, R = batch["prompt_len"], batch["response_mask"].shape[1]
    base = getattr(model, model.base_model_prefix)
    if not share_prompts or R == 1:
        return base(
            input_ids=batch["input_ids"][:, : P + R - 1],
            attention_mask=batch["attention_mask"][:, : P + R - 1],
            position_ids=batch["position_ids"][:, : P + R - 1],
        ).last_hidden_state[:, P - 1 :]
    idx = batch["prompt_index"]
    out = base(
        input_ids=batch["unique_ids"],
        attention_mask=batch["unique_mask"],
        position_ids=position_ids_from_mask(batch["unique_mask"]),
        use_cache=True,
    )
    first = out.last_hidden_state[:, -1:][idx]  # predicts response token 0
    past = out.past_key_values
    past.reorder_cache(idx)  # index_select per layer: differentiable, one cache row per sample
    rest = base(
        input_ids=batch["response_ids"][:, : R - 1],
        attention_mask=batch["attention_mask"][:, : P + R - 1],
        position_ids=batch["position_ids"][:, P : P + R - 1],
        past_key_values=past,
        use_cache=True,
    )
    return torch.cat([first, rest.last_hidden_state], 1)


def response_logprobs(
    model,
    batch: dict,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_grad: bool = True,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropies) of the response tokens under ``model`` at ``temperature``.

    The transformer runs as in ``response_hidden`` (shared prompts by default). The LM head runs on at
    most ``chunk_tokens`` real response tokens at a time and is recomputed in the backward pass
    (activation checkpointing), so the [tokens x vocab] logits never exist for the whole batch.
    Returns two [B, R] float32 tensors, zero where ``response_mask`` is False. A sharded model
    (``common.distributed.shard_model``) runs all of it as one FSDP forward (``fsdp_call``).
    """
    if is_sharded(model):
        return model.fsdp_call(_response_logprobs, batch, temperature, chunk_tokens, with_grad, share_prompts)
    return _response_logprobs(model, batch, temperature, chunk_tokens, with_grad, share_prompts)


def _response_logprobs(model, batch, temperature, chunk_tokens, with_grad, share_prompts):
    mask = batch["response_mask"]
    h = response_hidden(model, batch, share_prompts)[mask]
    targets = batch["response_ids"][mask]
    weight = model.get_output_embeddings().weight
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk_tokens):
        args = (h[i : i + chunk_tokens], weight, targets[i : i + chunk_tokens], temperature)
        lp, ent = (
            checkpoint(_chunk_logp_entropy, *args, use_reentrant=False) if with_grad else _chunk_logp_entropy(*args)
        )
        lps.append(lp)
        ents.append(ent)
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if lps:
        logp = logp.masked_scatter(mask, torch.cat(lps))
        entropy = entropy.masked_scatter(mask, torch.cat(ents).detach())
    return logp, entropy
