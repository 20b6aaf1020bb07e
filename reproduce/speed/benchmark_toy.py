"""The phases of a chain toy run, timed for this tree and for a baseline commit in one run, with the ratios.

    python reproduce/speed/benchmark_toy.py                      # against --baseline f594296, on one thread
    python reproduce/speed/benchmark_toy.py --baseline HEAD~3    # any commit of this repository

Each tree is measured in its own processes (its own common/ and algorithms/, extracted with `git archive`), on the
chain toy policy of seed 1 (built on first use, reproduce/toy/README.md), on the figures' workload: rollout batches of
16 prompts x 8 samples at temperature 0.7 with a 128-token budget, updates of 32 sequences (bf16 autocast, AdamW),
greedy evaluation of 500 held-out problems, and vineppo.py's Monte Carlo values (K = 3) of one batch's states. Each
phase runs in both trees under the same settings (the code's own speed-up), at the scripts' defaults and at the
settings the chain figures now pass (sweep.testbed_flags: --gen-batch-size 256, --attn-implementation eager,
--eval-batch-size 256):
- start-up: a fresh interpreter that imports what the scripts import and builds the tokenizer, model, task and
  engine (median of 3);
- generation: one rollout batch (median of --repeats after a warm-up);
- train step: one update's forward, backward and AdamW step (median of --repeats after a warm-up);
- evaluation: one greedy pass over the 500 problems;
- MC values: vineppo.py's mc_values on one batch's states;
- update: a quarter of the generation (4 updates per batch) plus the train step, the CPU time one update of a chain
  run costs, at the baseline with its settings against this tree with today's.
It checks that both trees give the same greedy accuracy (at both batch sizes) and train on the same tokens (the MC
completions differ: the engine now draws every sample's uniforms at once). Timings on a shared machine wander: run
it with nothing else running.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "reproduce"))

import tyro  # noqa: E402

SETUP = """
import sys, time
sys.path[:0] = [{root!r}, {root!r} + '/algorithms']
import torch
from common.engine import HFEngine, sample
from common.evaluation import greedy_eval
from common.logprobs import collate, response_logprobs
from common.models import load_model, load_tokenizer
from common.tasks import encode_prompt, make_task
torch.manual_seed(0)
tok, policy = load_tokenizer({model!r}), load_model({model!r})
task = make_task('chain', digits=1, data_path=None, eval_task=None, eval_data_path=None, eval_size=500,
                 prompt_template='auto', seed=1)
engine = HFEngine(policy, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
"""

MEASURE = """
import statistics, vineppo
encode = lambda row: encode_prompt(tok, task.prompt(row), task.chat)
rows = task.train_rows(0, 16)
unique = [encode(r) for r in rows]
def timed(f, *a, **k):
    t = time.perf_counter(); out = f(*a, **k); return time.perf_counter() - t, out
res = {{}}
for mb in (64, 256):  # the engine's batch: grpo.py's --gen-batch-size default, and the chain figures' (vineppo's)
    engine.max_batch = mb
    gen = lambda seed: engine.generate(unique, n=8, max_new_tokens=128, temperature=0.7, seed=seed)
    gen(0)
    res[f'generation_{{mb}}'] = statistics.median(timed(gen, k + 1)[0] for k in range({repeats}))
# the batch the train steps and MC values use: the same tokens in both trees (one sampler call, per-step draws)
responses = sample(engine.model, unique, n=8, max_new_tokens=128, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                   temperature=0.7, generator=torch.Generator().manual_seed(1), autocast=False)[0]
eval_prompts = [encode(r) for r in task.eval_rows]
acc = []
for bs in (64, 256):  # the scripts' --eval-batch-size default, and the chain figures'
    res[f'eval_{{bs}}'], m = timed(greedy_eval, policy, tok, eval_prompts, task.eval_rows, task.reward,
                                 eos_ids=[tok.eos_token_id], max_new_tokens=128, batch_size=bs, autocast=True)
    acc.append(m['eval/accuracy'])
prompts = [p for p in unique for _ in range(8)]
opt = torch.optim.AdamW(policy.parameters(), lr=3e-5)
def train_step(j):
    idx = list(range(32 * j, 32 * j + 32))
    opt.zero_grad(set_to_none=True)
    mb = collate([prompts[i] for i in idx], [responses[i] for i in idx], tok.pad_token_id)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logp, _ = response_logprobs(policy, mb, 0.7, 1024)
        loss = -(logp * mb['response_mask']).sum() / mb['response_mask'].sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
for attn in ('sdpa', 'eager'):  # the trainer's attention: transformers' default, and the chain figures'
    policy.set_attn_implementation(attn)
    train_step(0)
    res[f'train_{{attn}}'] = statistics.median(timed(train_step, k % 4)[0] for k in range({repeats}))
texts = [tok.batch_decode([[t] for t in r], skip_special_tokens=True) for r in responses]
states = list(dict.fromkeys((i // 8, tuple(r[:b])) for i, r in enumerate(responses)
                            for b in vineppo.mc_state_starts(vineppo.step_starts(texts[i]), 25)))
budgets = [(unique[g] + list(prefix), 128 - len(prefix)) for g, prefix in states]
engine.max_batch = 256  # vineppo.py's --gen-batch-size
mc_gen = lambda prefixes, n, T: [(o['response'], o['truncated']) for o in
                                 engine.generate(prefixes, n=n, max_new_tokens=T, temperature=0.7, seed=7)]
score = lambda j, c: task.reward(tok.decode([*states[j][1], *c], skip_special_tokens=True), rows[states[j][0]])
res['mc_values'], values = timed(vineppo.mc_values, budgets, 3, mc_gen, score)
res['mc_states'] = len(states)
res['check'] = [acc, sum(map(len, responses))]
print('RESULT', json.dumps(res))
"""


@dataclass
class Args:
    baseline: str = "f594296"
    """the commit to compare with (the code before the speed work of issue 35's section 2)"""
    repeats: int = 10
    """measured generations and train steps per tree (medians)"""
    threads: int = 1
    """intra-op threads (OMP_NUM_THREADS) of every measured process: 1, as each figure run has"""


def measure(root: str, model: str, args: Args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    setup = SETUP.format(root=root, model=model)
    starts = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", setup], env=env, check=True, capture_output=True)
        starts.append(time.perf_counter() - t)
    body = "import json\n" + setup + MEASURE.format(repeats=args.repeats)
    proc = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"measuring {root} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    out["start_up"] = statistics.median(starts)
    return out


if __name__ == "__main__":
    args = tyro.cli(Args)
    from sweep import toy_policy

    model = toy_policy(1, "chain")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", args.baseline, "common", "algorithms"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True)
        before = measure(base, model, args)
    after = measure(ROOT, model, args)
    print(f"chain toy policy (seed 1), {args.threads} thread(s); baseline {args.baseline}, tree {head.stdout.strip()}")
    print(f"| phase | {args.baseline} | this tree | speed-up |\n|---|---|---|---|")
    phases = [
        ("start-up", "start_up"),
        ("generation, one batch of 16 x 8, engine batch 64", "generation_64"),
        ("generation, one batch of 16 x 8, engine batch 256", "generation_256"),
        ("train step, 32 sequences, sdpa attention", "train_sdpa"),
        ("train step, 32 sequences, eager attention", "train_eager"),
        ("evaluation, 500 problems, batch 64", "eval_64"),
        ("evaluation, 500 problems, batch 256", "eval_256"),
        (f"MC values, K = 3, {after['mc_states']} states, engine batch 256", "mc_values"),
    ]
    for label, key in phases:
        print(f"| {label} | {before[key]:.3f} s | {after[key]:.3f} s | {before[key] / after[key]:.2f}x |")
    old = before["generation_64"] / 4 + before["train_sdpa"]  # a chain update as the figures ran it at the baseline
    new = after["generation_256"] / 4 + after["train_eager"]  # and as they run it now (sweep.testbed_flags)
    print(f"| update (generation / 4 + train step), figures' settings | {old:.3f} s | {new:.3f} s | {old / new:.2f}x |")
    old, new = before["eval_64"], after["eval_256"]
    print(f"| evaluation, the figures' settings | {old:.3f} s | {new:.3f} s | {old / new:.2f}x |")
    same = before["check"] == after["check"] and len(set(after["check"][0])) == 1
    print(f"same greedy accuracy (both batch sizes) and training tokens in both trees: {same} {after['check']}")
