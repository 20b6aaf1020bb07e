"""Build a toy policy: a small Llama (1.06M parameters for arithmetic, 0.31M for chain) with a character-level
tokenizer, warm-started by a short supervised phase so that RL has signal (accuracy well above 0, far below 1), on the
arithmetic task (2-digit addition, answered with the number) or the chain task (chained addition and subtraction, worked
one operation per line).

    python reproduce/toy/make_toy_policy.py        # -> ~/.cache/asyncrl/toy-arith-seed1 (common.models.cache_root)
    python algorithms/grpo.py --model ~/.cache/asyncrl/toy-arith-seed1

The tokenizer has one token per printable ASCII character (and newline) plus the special tokens <s>, </s>, <pad>, <unk>,
<|system|>, <|user|>, <|assistant|>; its chat template renders a user turn as ``<s><|user|>{text}<|assistant|>`` and an
assistant turn as ``{text}</s>``, so the model answers "<sum></s>" (the chain task's prompt is raw text, no chat
template: the expression is the line its first step reads, docs/tasks.md). The warm start trains on the task's training
stream (``task.train_rows``, which never yields a held-out problem) with the loss on the target tokens only (the answer,
or the worked solution), AdamW, and scores the task's held-out eval set as the algorithm scripts do
(``common.engine.sample``, bf16 autocast, the task's reward).

Where it stops is chosen by what RL will start from, not by a step count: the warm start learns addition in a steep jump
whose position depends on the seed and on the CPU's floating-point kernels, so a fixed step count lands far off on some
machines. Every --check-every steps it measures the greedy accuracy on the held-out problems and, once that is in its
band, the accuracy of one sample per problem at --temperature (the reward rate RL starts from), and stops at the first
check with both inside their bands (--band, --sampled-band). If a check jumps over a band, the weights and optimizer
state go back to the previous check and those steps are replayed with a check every --replay-every steps (after each
step for arithmetic; a coarser replay that jumps over again is replayed step by step; training is deterministic, so the
replay repeats them). No landing by --max-steps is an error. Then it measures what RL will meet: rollouts at the
figures' temperature and budget (steps per response, length median and 95th percentile, truncated fraction), the seconds
of one rollout batch and its updates, and at which step greedy answers first go wrong (with the per-step error rate).
The folder gets the model, the tokenizer and ``toy_policy.json`` with all of it (the step it stopped at, every check,
the bands, the config, the machine). Measurements: reproduce/toy/README.md.
"""

import copy
import json
import math
import os
import platform
import shutil
import string
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
import tyro

from common.engine import sample
from common.logprobs import collate, response_logprobs
from common.models import cache_root
from common.tasks import encode_prompt, make_task

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK, *ROLE_TOKENS)
CHARACTERS = string.printable[:95] + "\n"  # digits, letters, punctuation, space; then newline
# <s><|role|>content for every turn, </s> after an assistant turn; the generation prompt opens the assistant turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MANIFEST = "toy_policy.json"
# per task: operand digits, greedy- and sampled-accuracy bands, step cap, steps between checks (and between the checks
# of a replay), batch, micro-batches, learning rate, model shape, positions, generation budget, rollout statistics,
# folder name
TASK_DEFAULTS = {
    "arithmetic": {
        "digits": 2,
        "band": (0.28, 0.38),
        "sampled_band": (0.22, 0.32),
        "max_steps": 3000,
        "check_every": 25,
        "replay_every": 1,
        "batch_size": 64,
        "micro_batches": 1,
        "learning_rate": 1e-3,
        "hidden_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 512,
        "max_position_embeddings": 256,
        "eval_max_new_tokens": 16,
        "stats_prompts": 64,
        "stats_samples": 8,
        "name": "toy-arith",
    },
    "chain": {
        "digits": 1,
        "band": (0.25, 0.35),
        "sampled_band": (0.15, 0.35),
        "max_steps": 3000,
        "check_every": 200,
        "replay_every": 25,
        "batch_size": 32,
        "micro_batches": 4,
        "learning_rate": 1e-3,
        "hidden_size": 96,
        "num_layers": 2,
        "num_heads": 3,
        "num_kv_heads": 3,
        "intermediate_size": 384,
        "max_position_embeddings": 256,
        "eval_max_new_tokens": 128,
        "stats_prompts": 256,
        "stats_samples": 2,
        "name": "toy-chain",
    },
}


@dataclass
class Args:
    task: Literal["arithmetic", "chain"] = "arithmetic"
    """what the policy learns: 2-digit addition answered with the number (arithmetic), or chained addition and
    subtraction worked one operation per line (chain); the defaults marked 'per task' follow TASK_DEFAULTS"""
    out: str | None = None
    """output folder (default: <cache root>/toy-arith-seed<seed> or toy-chain-seed<seed>, with -<d>digit for a
    non-default --digits; cache root as in common/models.py: $ASYNCRL_CACHE, else $XDG_CACHE_HOME/asyncrl, else
    ~/.cache/asyncrl)"""
    digits: int | None = None
    """the problems' --digits (the scripts' difficulty knob; per task: 2 / 1)"""
    band: tuple[float, float] | None = None
    """greedy held-out accuracy the warm start must land in (LOW HIGH): training stops at the first check inside it;
    the reproduce/ figures assume the default band (per task: 0.28 0.38 / 0.25 0.35)"""
    sampled_band: tuple[float, float] | None = None
    """accuracy of one sample per held-out problem at --temperature (the reward rate RL starts from) that must hold at
    the same check (LOW HIGH; per task: 0.22 0.32 / 0.15 0.35)"""
    max_steps: int | None = None
    """step cap: a warm start with no check inside --band and --sampled-band by then is an error (per task: 3000 /
    3000)"""
    check_every: int | None = None
    """supervised steps between held-out accuracy checks (a check above a band replays those steps with a check
    every --replay-every steps; per task: 25 / 200)"""
    replay_every: int | None = None
    """steps between the checks of a replay (1: after every step; a check of a coarser replay that is above a band
    replays again with a check after every step; per task: 1 / 25)"""
    batch_size: int | None = None
    """problems per supervised step (per task: 64 / 32)"""
    micro_batches: int | None = None
    """forward/backward passes per supervised step: the step's problems sorted by length and cut into this many
    parts, so that short ones are not padded to the longest (the same loss, fewer padded tokens; per task: 1 /
    4)"""
    learning_rate: float | None = None
    """AdamW learning rate (constant after --warmup-steps; per task: 1e-3 / 1e-3)"""
    warmup_steps: int = 50
    """linear learning-rate warm-up, in steps (fixed, so a longer run repeats a shorter one's first steps)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    hidden_size: int | None = None
    """model width (per task: 128 / 96)"""
    num_layers: int | None = None
    """transformer layers (per task: 4 / 2)"""
    num_heads: int | None = None
    """attention heads (hidden_size / num_heads must be a multiple of 32 for vLLM's CPU attention; per task: 4 / 3)"""
    num_kv_heads: int | None = None
    """key/value heads (grouped-query attention when fewer than num_heads; per task: 4 / 3)"""
    intermediate_size: int | None = None
    """MLP width (per task: 512 / 384)"""
    max_position_embeddings: int | None = None
    """longest sequence the model takes (prompt + response; per task: 256 / 256)"""
    eval_size: int = 500
    """held-out problems of the accuracy checks (the reproduce/ figures' --eval-size: their update-0 evaluation
    scores the same problems)"""
    eval_max_new_tokens: int | None = None
    """generation budget of the evaluation and of the rollout statistics: the --max-new-tokens the figures use
    (per task: 16, grpo.py's default / 128)"""
    temperature: float = 0.7
    """sampling temperature of --sampled-band and the rollout statistics (the scripts' default)"""
    stats_prompts: int | None = None
    """held-out prompts sampled --stats-samples times each for the rollout statistics (per task: 64 / 256: enough
    problems for the length distribution of chain)"""
    stats_samples: int | None = None
    """samples per prompt for the rollout statistics (per task: 8, the figures' group size / 2)"""
    seed: int = 1
    """seed of the initialisation and of the training stream"""
    overwrite: bool = True
    """replace an existing toy policy at --out (a folder that is not one is never replaced)"""


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with a chat template: one token per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character on its own
    core.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=256,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_config(
    tokenizer,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
):
    """A small ``LlamaConfig`` for ``tokenizer`` with tied embeddings; bad shapes are a SystemExit."""
    from transformers import LlamaConfig

    if min(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings) < 1:
        raise SystemExit(
            "--hidden-size, --num-layers, --num-heads, --num-kv-heads, --intermediate-size and "
            "--max-position-embeddings must all be >= 1"
        )
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise SystemExit(
            f"--hidden-size {hidden_size} must be divisible by --num-heads {num_heads}, and --num-heads by "
            f"--num-kv-heads {num_kv_heads}"
        )
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(config, seed: int):
    """A randomly initialised ``LlamaForCausalLM`` whose generation config stops at the tokenizer's eos."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def target(row: dict) -> str:
    """What the warm start teaches for a problem: the worked solution where the task has one (chain), else the
    answer."""
    return row.get("solution", row["answer"])


def supervised_batch(task, tokenizer, rows: list[dict]) -> dict:
    """[chat prompt | target + "</s>"] tensors of ``rows`` (``common.logprobs.collate``), the loss on the target."""
    prompts = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in rows]
    answers = [tokenizer(target(r), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    return collate(prompts, answers, tokenizer.pad_token_id)


def supervised_batches(task, tokenizer, rows: list[dict], parts: int = 1) -> list[dict]:
    """``rows`` as ``parts`` supervised batches: with parts > 1 sorted by prompt + target length and cut into
    ``parts`` contiguous slices of (nearly) equal size, so that each is padded only to its own longest row."""
    if parts <= 1:
        return [supervised_batch(task, tokenizer, rows)]
    rows = sorted(rows, key=lambda r: len(task.prompt(r)) + len(target(r)))
    cuts = [len(rows) * k // parts for k in range(parts + 1)]
    return [supervised_batch(task, tokenizer, rows[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]


def supervised_step(model, optimizer, batch: dict | list[dict], max_grad_norm: float = 1.0) -> float:
    """One AdamW step (clipped gradients) on the mean negative log-likelihood of the answer tokens of ``batch`` (or of
    a list of batches together: gradients accumulate over them); returns that loss."""
    batches = [batch] if isinstance(batch, dict) else batch
    tokens = sum(b["response_mask"].sum() for b in batches)
    optimizer.zero_grad()
    total = 0.0
    for b in batches:
        logp, _ = response_logprobs(model, b, with_grad=False)  # tiny vocabulary: no need to checkpoint the head
        loss = -logp.sum() / tokens
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return total


@torch.no_grad()
def eval_texts(model, tokenizer, task, max_new_tokens: int = 16, batch_size: int = 64, **sampling) -> list[str]:
    """One response to each of ``task.eval_rows``, decoded, from the algorithm scripts' sampler (bf16 autocast);
    ``sampling``: ``greedy=True`` (their evaluation), or ``temperature`` and a ``generator``."""
    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in task.eval_rows]
    responses = []
    for i in range(0, len(prompts), batch_size):
        r, _, _ = sample(
            model,
            prompts[i : i + batch_size],
            max_new_tokens=max_new_tokens,
            eos_ids=[tokenizer.eos_token_id],
            pad_id=tokenizer.pad_token_id,
            **sampling,
        )
        responses += r
    model.train(was_training)
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


def accuracy_of(task, texts: list[str]) -> float:
    """Fraction of ``texts`` (one per eval row) that the task's reward scores correct."""
    return float(np.mean([task.reward(t, row) == 1.0 for t, row in zip(texts, task.eval_rows)]))


def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 16) -> float:
    """Greedy accuracy on ``task.eval_rows``, scored as the algorithm scripts' evaluation."""
    return accuracy_of(task, eval_texts(model, tokenizer, task, max_new_tokens, greedy=True))


def sampled_accuracy(model, tokenizer, task, max_new_tokens: int, temperature: float, seed: int = 1) -> float:
    """Accuracy of one sample per held-out problem at ``temperature`` (the sampler seeded with ``seed``, the same
    whatever the policy's seed): the reward rate RL starts from."""
    return accuracy_of(
        task,
        eval_texts(
            model,
            tokenizer,
            task,
            max_new_tokens,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        ),
    )


def steps_of(text: str) -> list[str]:
    """The non-empty lines of a response: its reasoning steps (the "#### result" line is the last one)."""
    return [line.strip() for line in text.split("\n") if line.strip()]


def first_wrong_step(text: str, solution: str) -> int:
    """1-based index of the first step of ``text`` that differs from the reference ``solution``'s step (a response
    that stops early is wrong at the step after its last one); 0 if every step matches."""
    mine, ref = steps_of(text), steps_of(solution)
    for i, line in enumerate(ref):
        if i >= len(mine) or mine[i] != line:
            return i + 1
    return 0 if len(mine) == len(ref) else len(ref) + 1


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


@torch.no_grad()
def rollout_stats(
    model, tokenizer, task, prompts: int, samples: int, max_new_tokens: int, temperature: float, seed: int
) -> dict:
    """What RL will see from this policy: ``samples`` responses to each of the first ``prompts`` held-out problems
    at ``temperature`` and the figures' budget: steps (non-empty lines) per response, response tokens (median,
    95th percentile and their ratio), the fraction that hit the budget, and the sampled accuracy; plus the
    seconds of that generation (one rollout batch of the figures' shape when prompts x samples = 16 x 8)."""
    model.eval()
    rows = task.eval_rows[:prompts]
    encoded = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in rows]
    t0 = time.perf_counter()
    responses, _, truncated = sample(
        model,
        encoded,
        max_new_tokens=max_new_tokens,
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
        temperature=temperature,
        n=samples,
        generator=torch.Generator().manual_seed(seed),
    )
    seconds = time.perf_counter() - t0
    model.train()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    golds = [r for r in rows for _ in range(samples)]
    lengths = [len(r) for r in responses]
    median = percentile(lengths, 0.5)
    return {
        "samples": len(texts),
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "steps_mean": float(np.mean([len(steps_of(t)) for t in texts])),
        "tokens_median": median,
        "tokens_p95": percentile(lengths, 0.95),
        "p95_over_median": percentile(lengths, 0.95) / max(median, 1),
        "truncated_frac": float(np.mean(truncated)),
        "accuracy": float(np.mean([task.reward(t, r) == 1.0 for t, r in zip(texts, golds)])),
        "generate_seconds": round(seconds, 3),
    }


def update_seconds(
    model, tokenizer, task, prompts: int, samples: int, max_new_tokens: int, temperature: float, minibatches: int = 4
) -> dict:
    """Seconds of one rollout batch of ``prompts`` x ``samples`` held-out problems (generation) and of training on it
    in ``minibatches`` optimizer updates (forward, backward and AdamW step, bf16 autocast, on a throwaway copy): the
    figures' work per rollout batch, on one thread as the sweeps run it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = copy.deepcopy(model)
        encoded = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in task.eval_rows[:prompts]]
        t0 = time.perf_counter()
        responses, _, _ = sample(
            work,
            encoded,
            max_new_tokens=max_new_tokens,
            eos_ids=[tokenizer.eos_token_id],
            pad_id=tokenizer.pad_token_id,
            temperature=temperature,
            n=samples,
            generator=torch.Generator().manual_seed(0),
        )
        generate = time.perf_counter() - t0
        repeated = [p for p in encoded for _ in range(samples)]
        optimizer = torch.optim.AdamW(work.parameters(), lr=1e-5)
        size = len(responses) // minibatches
        t0 = time.perf_counter()
        for i in range(0, size * minibatches, size):
            batch = collate(repeated[i : i + size], responses[i : i + size], tokenizer.pad_token_id)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = response_logprobs(work, batch)
            optimizer.zero_grad()
            (-logp.sum() / batch["response_mask"].sum()).backward()
            optimizer.step()
        train = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {
        "shape": f"{prompts} prompts x {samples} samples, {minibatches} updates, 1 thread",
        "generate_seconds": round(generate, 3),
        "train_seconds": round(train, 3),
        "seconds_per_update": round((generate + train) / minibatches, 3),
    }


def error_histogram(task, texts: list[str]) -> dict:
    """Of ``texts`` (greedy responses to ``task.eval_rows``, one each): how many are wrong, at which step they first
    go wrong (first_wrong_step; a wrong response whose every step matches counts as step 0), and for each step k the
    share of the responses still right before step k that go wrong at k (the per-step error rate: equal rates mean
    errors spread evenly over the steps, even though fewer responses reach the later ones)."""
    wrong = [(t, r) for t, r in zip(texts, task.eval_rows) if task.reward(t, r) != 1.0]
    hist: dict[int, int] = {}
    for t, r in wrong:
        k = first_wrong_step(t, target(r))
        hist[k] = hist.get(k, 0) + 1
    rates, reached = {}, len(texts)  # reached: the responses with no wrong step before k
    for k in range(1, max(hist, default=0) + 1):
        if hist.get(k):
            rates[k] = round(hist[k] / reached, 3)
        reached -= hist.get(k, 0)
    return {
        "wrong": len(wrong),
        "of": len(texts),
        "first_wrong_step": dict(sorted(hist.items())),
        "wrong_rate_at_step": rates,
    }


def default_out(task: str = "arithmetic", digits: int | None = None, seed: int = 1) -> str:
    """<cache root>/toy-arith-seed<seed> or toy-chain-seed<seed> (where reproduce/sweep.py looks for the policy of
    training seed <seed>), with -<d>digit before -seed when ``digits`` is not the task's default."""
    name, default = TASK_DEFAULTS[task]["name"], TASK_DEFAULTS[task]["digits"]
    return str(cache_root() / f"{name if digits in (None, default) else f'{name}-{digits}digit'}-seed{seed}")


def check_out(out: str, overwrite: bool) -> str:
    """The absolute output folder; a SystemExit if it holds something other than a toy policy (or one and not
    ``overwrite``)."""
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out):
        if not os.path.isdir(out) or (not os.path.isfile(os.path.join(out, MANIFEST)) and os.listdir(out)):
            raise SystemExit(f"--out {out}: exists and is not a toy policy (no {MANIFEST}); pick another folder.")
        if not overwrite:
            raise SystemExit(f"--out {out}: a toy policy is already there; pass --overwrite or another --out.")
    return out


def save(model, tokenizer, manifest: dict, out: str, overwrite: bool) -> str:
    """Write model + tokenizer + manifest into ``out`` atomically (a half-written folder never looks finished)."""
    out = check_out(out, overwrite)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def check_band(band: tuple[float, float], flag: str = "--band") -> None:
    """A SystemExit unless ``band`` is LOW HIGH with 0 <= LOW <= HIGH <= 1."""
    if not 0.0 <= band[0] <= band[1] <= 1.0:
        raise SystemExit(f"{flag} {band[0]} {band[1]}: give LOW HIGH with 0 <= LOW <= HIGH <= 1")


def train_into_band(
    model,
    optimizer,
    train_step,
    score,
    bands: dict[str, tuple[float, float]],
    max_steps: int,
    check_every: int,
    report=lambda step, scores: None,
    replay_every: int = 1,
) -> tuple[int, dict, list[dict]]:
    """Call ``train_step(step)`` for step = 0, 1, ... and ``score()`` (a dict with a value for every name in
    ``bands``, or None where it was not measured: outside its band, never above it) after every ``check_every``
    steps until a check has every value inside its band (inclusive); returns (steps taken, those scores, every check
    as {step, **scores}). A check with a value above its band restores ``model`` and ``optimizer`` to the previous
    check and replays the steps since then with a check every ``replay_every`` steps (and at the step that jumped),
    and a check of such a replay (``replay_every`` > 1) that is above a band replays again with a check after each
    step (``train_step`` must be a function of its step, so a replay repeats them); no check inside the bands
    within ``max_steps`` steps is a SystemExit."""
    checks: list[dict] = []
    saved = (0, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    step, every, origin, until = 0, check_every, 0, 0  # checks at origin + k * every; a replay ends at ``until``
    while step < max_steps:
        train_step(step)
        step += 1
        if until and step > until:  # the replay is over: back to the regular checks
            every, origin, until = check_every, 0, 0
        if (step - origin) % every and step != until and step != max_steps:
            continue
        scores = score()
        checks.append({"step": step, **scores})
        report(step, scores)
        if all(scores[k] is not None and low <= scores[k] <= high for k, (low, high) in bands.items()):
            return step, scores, checks
        over = any(scores[k] is not None and scores[k] > high for k, (_, high) in bands.items())
        if over and every > 1 and step - saved[0] > 1:  # jumped over a band: replay with finer checks
            every = replay_every if 1 < replay_every < every else 1
            origin, until, step = saved[0], step, saved[0]
            model.load_state_dict(saved[1])
            optimizer.load_state_dict(copy.deepcopy(saved[2]))
            continue
        saved = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    wanted = ", ".join(f"{k} in [{low}, {high}]" for k, (low, high) in bands.items())
    last = "; ".join(
        f"step {c['step']}: " + ", ".join(f"{k} {'-' if c[k] is None else f'{c[k]:.3f}'}" for k in bands)
        for c in checks[-4:]
    )
    raise SystemExit(
        f"the warm start never landed in its bands ({wanted}) within --max-steps {max_steps} (last "
        f"checks: {last}); raise --max-steps, widen --band / --sampled-band, or change "
        f"--learning-rate or --seed"
    )


def cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    args = tyro.cli(Args)
    defaults = TASK_DEFAULTS[args.task]
    args = replace(args, **{k: v for k, v in defaults.items() if k != "name" and getattr(args, k) is None})
    if args.digits < 1:
        raise SystemExit(f"--digits must be >= 1, got {args.digits}")
    if (
        min(
            args.max_steps,
            args.check_every,
            args.replay_every,
            args.batch_size,
            args.micro_batches,
            args.eval_size,
            args.eval_max_new_tokens,
            args.stats_prompts,
            args.stats_samples,
        )
        < 1
    ):
        raise SystemExit(
            "--max-steps, --check-every, --replay-every, --batch-size, --micro-batches, --eval-size, "
            "--eval-max-new-tokens, --stats-prompts and --stats-samples must be >= 1"
        )
    if args.learning_rate <= 0 or args.temperature <= 0:
        raise SystemExit(f"--learning-rate and --temperature must be > 0, got {args.learning_rate}, {args.temperature}")
    check_band(args.band)
    check_band(args.sampled_band, "--sampled-band")
    out = check_out(args.out or default_out(args.task, args.digits, args.seed), args.overwrite)  # before training

    task = make_task(args.task, digits=args.digits, eval_size=args.eval_size, seed=args.seed)
    tokenizer = build_tokenizer()
    config = build_config(
        tokenizer,
        args.hidden_size,
        args.num_layers,
        args.num_heads,
        args.num_kv_heads,
        args.intermediate_size,
        args.max_position_embeddings,
    )
    longest = max(len(encode_prompt(tokenizer, task.prompt(r))) for r in task.eval_rows)
    response = max(args.eval_max_new_tokens, *(len(target(r)) + 1 for r in task.eval_rows))
    if longest + response > config.max_position_embeddings:
        raise SystemExit(
            f"--max-position-embeddings {config.max_position_embeddings} is too small for {args.task} "
            f"prompts of up to {longest} tokens plus responses of up to {response} tokens"
        )
    model = build_model(config, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"[toy] {n_params / 1e6:.2f}M-parameter Llama ({args.num_layers} layers, hidden {args.hidden_size}), "
        f"vocabulary {len(tokenizer)}; task {args.task}, --digits {args.digits}, prompts of up to {longest} tokens; "
        f"batches of {args.batch_size} until, on {len(task.eval_rows)} held-out problems, the greedy accuracy is in "
        f"[{args.band[0]}, {args.band[1]}] and the sampled one (temperature {args.temperature}) in "
        f"[{args.sampled_band[0]}, {args.sampled_band[1]}] (at most {args.max_steps} steps) on "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    model.train()
    losses: dict[int, float] = {}  # supervised loss after each step (a replayed step overwrites its own)
    t0 = time.perf_counter()

    def train_step(step: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate * min(1.0, (step + 1) / max(1, args.warmup_steps))
        batches = supervised_batches(task, tokenizer, task.train_rows(step, args.batch_size), args.micro_batches)
        losses[step + 1] = supervised_step(model, optimizer, batches, args.max_grad_norm)

    greedy_texts: list[str] = []  # the latest check's greedy responses (those of the policy saved, at the end)

    def score() -> dict:
        greedy_texts[:] = eval_texts(model, tokenizer, task, args.eval_max_new_tokens, greedy=True)
        greedy = accuracy_of(task, greedy_texts)
        # the sampled accuracy only once the greedy one has reached its band (below it, no check can land)
        sampled = None
        if greedy >= args.band[0]:
            sampled = sampled_accuracy(model, tokenizer, task, args.eval_max_new_tokens, args.temperature)
        return {"greedy": greedy, "sampled": sampled}

    def report(step: int, scores: dict) -> None:
        sampled = "not measured" if scores["sampled"] is None else f"{scores['sampled']:.3f}"
        print(
            f"[toy] step {step}: loss {losses[step]:.4f}, greedy eval accuracy {scores['greedy']:.3f}, sampled "
            f"{sampled} ({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )

    steps, scores, checks = train_into_band(
        model,
        optimizer,
        train_step,
        score,
        {"greedy": args.band, "sampled": args.sampled_band},
        args.max_steps,
        args.check_every,
        report,
        args.replay_every,
    )
    seconds = time.perf_counter() - t0
    print(
        f"[toy] warm start {seconds:.1f}s, {steps} steps; greedy eval accuracy {scores['greedy']:.3f}, sampled "
        f"{scores['sampled']:.3f} on {len(task.eval_rows)} held-out problems",
        flush=True,
    )

    # what RL will meet: rollouts at the figures' temperature and budget, the speed of an update, where errors are
    rollouts = rollout_stats(
        model,
        tokenizer,
        task,
        args.stats_prompts,
        args.stats_samples,
        args.eval_max_new_tokens,
        args.temperature,
        args.seed,
    )
    speed = update_seconds(model, tokenizer, task, 16, 8, args.eval_max_new_tokens, args.temperature)
    errors = error_histogram(task, greedy_texts)
    print(
        f"[toy] rollouts ({rollouts['samples']} at temperature {args.temperature}, {args.eval_max_new_tokens} new "
        f"tokens): {rollouts['steps_mean']:.2f} steps per response, median {rollouts['tokens_median']:.0f} tokens, "
        f"95th percentile {rollouts['tokens_p95']:.0f} ({rollouts['p95_over_median']:.2f}x), "
        f"{100 * rollouts['truncated_frac']:.1f}% hit the budget, sampled accuracy {rollouts['accuracy']:.3f}",
        flush=True,
    )
    print(
        f"[toy] one rollout batch of {speed['shape']}: generation {speed['generate_seconds']:.2f}s + training "
        f"{speed['train_seconds']:.2f}s = {speed['seconds_per_update']:.2f}s per update",
        flush=True,
    )
    print(
        f"[toy] greedy errors: {errors['wrong']} of {errors['of']} wrong; first wrong step: "
        + ", ".join(f"{k}: {v}" for k, v in errors["first_wrong_step"].items())
        + "; per-step error rate: "
        + ", ".join(f"{k}: {v:.0%}" for k, v in errors["wrong_rate_at_step"].items()),
        flush=True,
    )
    manifest = {
        "task": args.task,
        "digits": args.digits,
        "steps": steps,
        "band": list(args.band),
        "sampled_band": list(args.sampled_band),
        "warm_start_seconds": round(seconds, 2),
        "eval_accuracy": scores["greedy"],
        "sampled_accuracy": scores["sampled"],
        "eval_size": len(task.eval_rows),
        "eval_decoding": f"greedy, bf16 autocast, {args.eval_max_new_tokens} new tokens",
        "final_loss": losses[steps],
        "rollouts": rollouts,
        "update_seconds": speed,
        "greedy_errors": errors,
        "num_parameters": n_params,
        "vocab_size": len(tokenizer),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": cpu_name(),
        "checks": checks,
        "args": asdict(args),
    }
    out = save(model, tokenizer, manifest, out, args.overwrite)
    print(
        f"[toy] saved {out}\n[toy] use it with: python algorithms/grpo.py --model {out} --task {args.task} "
        f"--digits {args.digits} --max-new-tokens {args.eval_max_new_tokens}",
        flush=True,
    )
