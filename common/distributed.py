"""Data-parallel training over ``torchrun`` ranks with FSDP2, and the few collectives the scripts need.

A plain ``python algorithms/x.py`` is rank 0 of a world of 1: nothing is sharded and every helper here
passes its input through, so single-process runs take exactly the code path they always took.
Under ``torchrun --nproc-per-node N`` each rank is one trainer process (one GPU each, or a CPU process
with gloo); rank 0 also owns the rollout engine, the rollout queue, logging and checkpoints.
"""

import datetime
import os
import sys
import types

import torch
import torch.distributed as dist


def init_distributed(cuda: bool = True, timeout_minutes: float = 120.0) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process. Under torchrun (``WORLD_SIZE`` > 1) it joins the process group:
    NCCL with one GPU per rank (``cuda:LOCAL_RANK``) when CUDA is available and ``cuda``, gloo on CPUs, with
    collectives that fail after ``timeout_minutes`` (torch's 10-minute NCCL default is shorter than a long rollout
    batch, a vLLM start or a large checkpoint, which the other ranks wait for in a collective)."""
    if not timeout_minutes > 0:
        raise SystemExit(f"--dist-timeout-minutes must be > 0, got {timeout_minutes}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cuda and torch.cuda.is_available()
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise SystemExit(
            f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; start at "
            f"most that many processes per node (torchrun --nproc-per-node)"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            device_id=device if use_cuda else None,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return (dist.get_rank() if world > 1 else 0), world, device


def is_sharded(model) -> bool:
    return hasattr(model, "fsdp_call")


def shard_model(model, device: torch.device):
    """FSDP2 (``fully_shard``) over all ranks, each rank's shards on ``device``: each transformer block (a module
    whose class name ends in ``DecoderLayer``, as in every HF decoder) is one shard group, the root holds the rest
    (embeddings, final norm, LM head, a value head). A world of 1: the model moved to ``device``.

    The weights are rank 0's: its model is the loaded one (in CPU memory), the other ranks' may be built on the meta
    device (``load_model(meta=True)``) or hold anything. Rank 0 keeps a reference to its full state dict in CPU
    memory, FSDP places each rank's shard of every parameter on ``device``, and the full tensors reach the shards
    from rank 0 one at a time, buffers too (the rotary frequencies are in no state dict): no rank holds the full
    fp32 model on its device.

    Gradients are summed over ranks, not averaged (divide factor 1): each rank's loss is its share of the
    minibatch loss, normalised by the minibatch's global sizes, so the shares add up to the one-process loss.
    ``response_logprobs`` and ``sample`` run the base model and the LM head directly rather than ``model.forward``;
    they go through ``model.fsdp_call(fn, ...)``, registered as a forward method, so FSDP all-gathers the root's
    parameters and reduce-scatters their gradients around them as it does around ``forward``.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model.to(device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise SystemExit(f"cannot shard {type(model).__name__}: no transformer blocks (*DecoderLayer modules) found")
    full = model.state_dict() if dist.get_rank() == 0 else {}  # CPU tensors, kept through the moves below
    # the mesh of the device type asked for: without one, fully_shard builds it on the accelerator torch was built
    # for, a CUDA mesh over a gloo group for a --no-cuda run on a GPU node
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    # resharded after every forward, the root too (all-gathered again for backward): a root kept gathered after a
    # forward without backward (no_grad passes) would keep serving its pre-update weights after optimizer.step
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if dist.get_rank() != 0:  # memory for a model built on the meta device; its values come from rank 0 below
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    del full
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    model.fsdp_call = types.MethodType(lambda self, fn, *args, **kwargs: fn(self, *args, **kwargs), model)
    register_fsdp_forward_method(model, "fsdp_call")
    with torch.no_grad():
        model.fsdp_call(lambda self: None)  # FSDP initialises from the root's first forward: before any layer's
    return model


def full_model_state(model) -> dict:
    """The model's full (unsharded) state dict on CPU, keyed by parameter name, on rank 0 (empty on the other ranks;
    every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_state_dicts(model, optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's full (unsharded) state dicts on CPU, keyed by parameter name, on rank 0
    (empty on the other ranks). The same format for any number of ranks: a checkpoint resumes on any other. An
    optimizer that has not stepped yet (update 0, or only skipped steps) gives ``{"state": {}, "param_groups": []}``
    and is left as it is (torch's get_optimizer_state_dict would first give it a state by a zero step, which counts
    as AdamW's first step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not broadcast(bool(optimizer.state)):  # rank 0's answer: the ranks step together
        return full_model_state(model), {"state": {}, "param_groups": []}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return full_model_state(model), get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state_dicts(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load ``full_state_dicts`` output: rank 0's dicts are broadcast and re-sharded to every rank (the other ranks'
    are ignored; every rank may pass what it read). The dicts are consumed: under torchrun their tensors are
    replaced by this rank's shards. An optimizer state without entries (saved before the first step) leaves
    ``optimizer`` as new, so its first step is AdamW's first (set_optimizer_state_dict would count a zero step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    stepped = broadcast(bool(optimizer_state.get("state")))  # rank 0's checkpoint decides
    if dist.is_initialized() and dist.get_rank() != 0:
        model_state, optimizer_state = {}, {}
    set_model_state_dict(model, model_state, options=options)
    if stepped:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def barrier() -> None:
    """Wait until every rank gets here (one process: return at once)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown(exit_code: int = 0) -> None:
    """Leave the process group at the end of a run (torchrun). Ranks other than 0 then exit at once with
    ``exit_code``: they hold nothing to flush (rank 0 logs, checkpoints and owns the engine), and skipping the
    interpreter's teardown avoids gloo's threads aborting it ("terminate called without an active exception",
    seen on CPUs when rank 0 outlives them). One process: nothing to do (a process group there is one an
    in-process vLLM engine made, and vLLM's own finaliser destroys it at exit)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or not dist.is_initialized():
        return
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def broadcast(value):
    """Rank 0's ``value`` (any picklable object) on every rank; every rank must call it. One process: ``value``."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks(value) -> list:
    """``value`` from every rank, in rank order (tensors arrive on CPU); every rank must call it. One process:
    [value]."""
    if not dist.is_initialized():
        return [_to_cpu(value)]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, _to_cpu(value))
    return out


def merge_ranks(*values):
    """Combine per-rank training statistics over all ranks (every rank must call it): numbers are summed, lists
    concatenated in rank order, and a dict of lists of tensors (per-token statistics collected micro-batch by
    micro-batch) becomes a dict of single tensors, concatenated in rank order. One process: the same combination
    of its own values. Returns a tuple when given several values."""
    gathered = all_ranks(values)
    out = []
    for i, v in enumerate(values):
        parts = [g[i] for g in gathered]
        if isinstance(v, dict):
            out.append({k: torch.cat([t for p in parts for t in p[k]]) for k in v})
        elif isinstance(v, list):
            out.append([x for p in parts for x in p])
        else:
            out.append(sum(parts))
    return out[0] if len(out) == 1 else tuple(out)


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
