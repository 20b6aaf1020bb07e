"""Checks of common/distributed.py on 2 ranks, run by tests/test_distributed.py as
``torchrun --standalone --nproc-per-node 2 tests/distributed_checks.py MODEL_DIR``; exits non-zero on a failure.

Each rank also builds the unsharded model, so every sharded result is compared with the one-process computation.
"""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.distributed import (
    all_ranks,
    barrier,
    broadcast,
    full_state_dicts,
    init_distributed,
    is_sharded,
    load_full_state_dicts,
    merge_ranks,
    shard_model,
    shutdown,
)
from common.engine import HFEngine, sample, weight_payload
from common.evaluation import greedy_eval
from common.logprobs import collate, response_logprobs
from common.models import load_model


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


if __name__ == "__main__":
    model_dir = sys.argv[1]
    rank, world, device = init_distributed(cuda=False)
    assert (world, device.type) == (2, "cpu") and rank in (0, 1), (rank, world, device)

    # collectives on plain values
    assert broadcast({"rank": rank}) == {"rank": 0}
    assert all_ranks(rank * 10) == [0, 10]
    toks, total, names = merge_ranks(
        {"x": [torch.full((2,), float(rank)), torch.tensor([5.0 + rank])]}, rank + 1.5, [f"r{rank}"]
    )
    assert toks["x"].tolist() == [0, 0, 5, 1, 1, 6] and total == 4.0 and names == ["r0", "r1"], (toks, total, names)

    # a sharded trainer's gradients are the one-process gradients of the whole batch (summed over ranks)
    torch.manual_seed(0)
    full = load_model(model_dir)
    model = shard_model(copy.deepcopy(full), device)
    assert is_sharded(model) and not is_sharded(full)
    # rank 0's weights reach a rank whose model was built on the meta device, its buffers (rotary frequencies) too
    from_meta = shard_model(load_model(model_dir, meta=rank != 0), device)
    assert all(not p.is_meta for p in from_meta.parameters()) and all(not b.is_meta for b in from_meta.buffers())
    for (n, p), q in zip(from_meta.named_parameters(), full.parameters()):
        assert close(p.full_tensor(), q, 0.0), f"{n} did not reach rank {rank} from rank 0"
    for (n, b), c in zip(from_meta.named_buffers(), full.buffers()):
        assert close(b, c, 0.0), f"buffer {n} did not reach rank {rank} from rank 0"
    del from_meta
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [10, 11, 12, 13], [10, 11, 12, 13], [7, 7], [9, 9]]
    responses = [[20, 21, 22], [20, 21], [23, 24, 25, 26], [23], [27, 28], [29], [30, 30, 30, 30, 30], [31]]
    n_tokens = sum(len(r) for r in responses)
    mine = list(range(rank * 4, rank * 4 + 4))
    mb = collate([prompts[i] for i in mine], [responses[i] for i in mine], 0)
    logp, _ = response_logprobs(model, mb, temperature=0.7, chunk_tokens=4)
    (-(logp * mb["response_mask"]).sum() / n_tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    mb_all = collate(prompts, responses, 0)
    logp_all, _ = response_logprobs(full, mb_all, temperature=0.7, chunk_tokens=4)
    (-(logp_all * mb_all["response_mask"]).sum() / n_tokens).backward()
    assert close(logp, logp_all[mine, : logp.shape[1]]), "sharded log-probs differ from the unsharded model's"
    for n, p in full.named_parameters():
        assert close(grads[n], p.grad), f"gradient of {n} differs from the one-process gradient"

    # full state dicts: rank 0 holds them; they load into a fresh sharded model and into a plain one
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    assert (len(model_state) > 0) == (rank == 0) and set(optimizer_state) <= {"state", "param_groups"}
    if rank == 0:  # plain tensors in the format a one-process run reads (checked first: a broadcast load consumes them)
        load_model(model_dir).load_state_dict(model_state)
    fresh = shard_model(load_model(model_dir), device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_full_state_dicts(fresh, fresh_opt, model_state, optimizer_state)  # rank 1 passes its empty dicts
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert close(p.full_tensor(), q.full_tensor(), 0.0), f"{n} not restored"
    assert fresh_opt.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()

    # weight sync: the payload is gathered on rank 0 only, and an engine loaded with it matches the trainer
    payload = weight_payload(model, torch.float32, keep=rank == 0)
    assert (payload is None) == (rank != 0)
    engine = HFEngine(load_model(model_dir), eos_ids=[], pad_id=0, dtype=torch.float32) if rank == 0 else None
    if rank == 0:
        engine.load_weights(payload, 1)
        outs = engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=5, temperature=0.7, seed=3, n=2)
    outs = broadcast(outs if rank == 0 else None)
    sync_mb = collate([[5, 6, 7]] * 2 + [[8, 9]] * 2, [o["response"] for o in outs], 0)
    with torch.no_grad():
        logp_trainer, _ = response_logprobs(model, sync_mb, temperature=0.7, with_grad=False)
    behav = torch.tensor([o["logprobs"] for o in outs])
    diff = (logp_trainer - behav).abs()[sync_mb["response_mask"]].max().item()
    assert diff < 2e-4, f"engine log-probs after a sync from 2 ranks differ from the trainer's by {diff}"

    # sharded, in lockstep: each rank its own prompts and eos, the same budget, as the unsharded model decodes them
    plain = load_model(model_dir)
    plain.load_state_dict({n: t.full_tensor() for n, t in model.state_dict().items()})
    rank_prompts = [[5, 6, 7]] if rank == 0 else [[8, 9], [10, 11, 12]]
    eos = [22] if rank == 0 else []
    got = sample(model, rank_prompts, max_new_tokens=6, eos_ids=eos, pad_id=0, greedy=True, autocast=False)[0]
    want = sample(plain, rank_prompts, max_new_tokens=6, eos_ids=eos, pad_id=0, greedy=True, autocast=False)[0]
    assert got == want, ("lockstep", got, want)
    # greedy_eval on the sharded model: 5 problems (3 + 2) in passes of 2, the second rank's last pass padded
    eval_prompts, rows = [[5, 6, 7], [8, 9], [10, 11, 12], [7, 7], [9, 9]], list(range(5))
    texts = [
        str(r)
        for r in sample(plain, eval_prompts, max_new_tokens=4, eos_ids=[], pad_id=0, greedy=True, autocast=False)[0]
    ]

    class Decoder:  # token ids as text, so that the verifier can compare them
        pad_token_id = 0

        @staticmethod
        def batch_decode(responses, skip_special_tokens=True):
            return [str(r) for r in responses]

    def reward(text, row):
        return float(text == texts[row] and row % 2 == 0)  # problems 0, 2, 4 correct, each against its own row

    metrics = greedy_eval(
        model, Decoder, eval_prompts, rows, reward, eos_ids=[], max_new_tokens=4, batch_size=2, autocast=False
    )
    assert metrics == {"eval/accuracy": 0.6, "eval/truncated_frac": 1.0, "eval/response_length_mean": 4.0}, metrics
    with torch.no_grad():  # and the model is sharded again afterwards: a collective forward still works
        again, _ = response_logprobs(model, sync_mb, temperature=0.7, with_grad=False)
    assert close(again, logp_trainer)

    barrier()
    print(f"rank {rank}: all distributed checks passed (engine-trainer log-prob gap {diff:.2e})", flush=True)
    shutdown()
