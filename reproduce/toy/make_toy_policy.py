"""Build a toy policy for the arithmetic task: a ~1M-parameter Llama with a character-level tokenizer, warm-started
by a short supervised phase so that RL has signal (greedy accuracy well above 0, far below 1).

    python reproduce/toy/make_toy_policy.py                # -> ~/.cache/asyncrl/toy-arith (see common.models.cache_root)
    python algorithms/grpo.py --model ~/.cache/asyncrl/toy-arith

The tokenizer has one token per printable ASCII character (and newline) plus the special tokens <s>, </s>, <pad>,
<unk>, <|system|>, <|user|>, <|assistant|>; its chat template renders a user turn as
``<s><|user|>{text}<|assistant|>`` and an assistant turn as ``{text}</s>``, so the model answers "<sum></s>".
The warm start trains on the task's training stream (``task.train_rows``, which never yields a held-out problem)
with the loss on the answer tokens only, for a fixed number of AdamW steps, then scores greedy decoding on the
task's held-out eval set exactly as the algorithm scripts do (``common.engine.sample``, bf16 autocast, the task's
reward). The folder gets the model, the tokenizer and ``toy_policy.json`` (steps, seconds, eval accuracy, config).

Measured with the defaults (--digits 2, 600 steps of 64, lr 3e-3, seed 1; torch 2.13 CPU, 2 threads, 2-core
machine, CPU otherwise idle): warm start 98.6 s, greedy accuracy 0.38 on the 200 held-out problems (with another
job on the cores the same run took 205 s; the result is identical, the run is deterministic). One grpo.py update on
it (8 prompts x 8 samples) takes about 0.03-0.05 s of rollout and 0.1-0.15 s of training.
Accuracy along the same run (--eval-every 100): 0.01 / 0.03 / 0.03 / 0.045 / 0.11 / 0.38 at steps 100..600, and
0.14 at step 575: the jump is steep, so a different --steps or torch build can land well off the band; a longer
run reaches ~0.5 at step 800 and then becomes unstable at this learning rate (0.40 at 900, 0.04 at 1100).
"""

import json
import os
import platform
import shutil
import string
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
import tyro

from common.batching import collate, response_logprobs
from common.engine import sample
from common.models import cache_root
from common.tasks import encode_prompt, make_task

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK, *ROLE_TOKENS)
CHARACTERS = string.printable[:95] + "\n"  # digits, letters, punctuation, space; then newline
# <s><|role|>content for every turn, </s> after an assistant turn; the generation prompt opens the assistant turn
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MANIFEST = "toy_policy.json"


@dataclass
class Args:
    out: str | None = None
    """output folder (default: <cache root>/toy-arith for --digits 2, toy-arith-<d>digit otherwise; cache root as in
    common/models.py: $ASYNCRL_CACHE, else $XDG_CACHE_HOME/asyncrl, else ~/.cache/asyncrl)"""
    digits: int = 2
    """digits per operand of the arithmetic problems trained and scored on (the scripts' --digits)"""
    steps: int = 600
    """supervised warm-start steps (AdamW); the default lands in the 20-40% greedy-accuracy band on --digits 2
    (measured: 0.38; module docstring)"""
    batch_size: int = 64
    """problems per supervised step"""
    learning_rate: float = 3e-3
    """AdamW learning rate (constant after --warmup-steps)"""
    warmup_steps: int = 50
    """linear learning-rate warm-up, in steps (fixed, so a longer run repeats a shorter one's first steps)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    hidden_size: int = 128
    """model width"""
    num_layers: int = 4
    """transformer layers"""
    num_heads: int = 4
    """attention heads (hidden_size / num_heads must be a multiple of 32 for vLLM's CPU attention)"""
    num_kv_heads: int = 4
    """key/value heads (grouped-query attention when fewer than num_heads)"""
    intermediate_size: int = 512
    """MLP width"""
    max_position_embeddings: int = 256
    """longest sequence the model takes (prompt + response)"""
    eval_size: int = 200
    """held-out problems scored after the warm start (the scripts' --eval-size)"""
    eval_max_new_tokens: int = 16
    """greedy generation budget of that evaluation (grpo.py's default --max-new-tokens)"""
    eval_every: int = 0
    """also score the held-out set every N steps while training (0: only at the end)"""
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
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                  additional_special_tokens=list(ROLE_TOKENS), model_max_length=256,
                                  padding_side="left", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_config(tokenizer, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 4,
                 intermediate_size: int = 512, max_position_embeddings: int = 256):
    """A small ``LlamaConfig`` for ``tokenizer`` with tied embeddings; bad shapes are a SystemExit."""
    from transformers import LlamaConfig

    if min(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings) < 1:
        raise SystemExit("--hidden-size, --num-layers, --num-heads, --num-kv-heads, --intermediate-size and "
                         "--max-position-embeddings must all be >= 1")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise SystemExit(f"--hidden-size {hidden_size} must be divisible by --num-heads {num_heads}, and --num-heads by "
                         f"--num-kv-heads {num_kv_heads}")
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_model(config, seed: int):
    """A randomly initialised ``LlamaForCausalLM`` whose generation config stops at the tokenizer's eos."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def supervised_batch(task, tokenizer, rows: list[dict]) -> dict:
    """[chat prompt | "<sum></s>"] tensors of ``rows`` (``common.batching.collate``), the loss goes on the answer."""
    prompts = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in rows]
    answers = [tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    return collate(prompts, answers, tokenizer.pad_token_id)


def supervised_step(model, optimizer, batch: dict, max_grad_norm: float = 1.0) -> float:
    """One AdamW step (clipped gradients) on the mean negative log-likelihood of the answer tokens; returns that loss."""
    logp, _ = response_logprobs(model, batch, with_grad=False)  # tiny vocabulary: no need to checkpoint the head
    loss = -logp.sum() / batch["response_mask"].sum()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 16, batch_size: int = 64) -> float:
    """Greedy accuracy on ``task.eval_rows``, scored as the algorithm scripts' evaluation (bf16 autocast)."""
    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, task.prompt(r), task.chat) for r in task.eval_rows]
    responses = []
    for i in range(0, len(prompts), batch_size):
        r, _, _ = sample(model, prompts[i:i + batch_size], max_new_tokens=max_new_tokens,
                         eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id, greedy=True)
        responses += r
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    model.train(was_training)
    return float(np.mean([task.reward(t, row) == 1.0 for t, row in zip(texts, task.eval_rows)]))


def default_out(digits: int) -> str:
    """<cache root>/toy-arith (2 digits) or <cache root>/toy-arith-<d>digit."""
    return str(cache_root() / ("toy-arith" if digits == 2 else f"toy-arith-{digits}digit"))


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


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.digits < 1:
        raise SystemExit(f"--digits must be >= 1, got {args.digits}")
    if args.steps < 0 or args.batch_size < 1 or args.eval_size < 1 or args.eval_max_new_tokens < 1 or args.eval_every < 0:
        raise SystemExit("--steps and --eval-every must be >= 0; --batch-size, --eval-size and --eval-max-new-tokens >= 1")
    if args.learning_rate <= 0:
        raise SystemExit(f"--learning-rate must be > 0, got {args.learning_rate}")
    out = check_out(args.out or default_out(args.digits), args.overwrite)  # before minutes of training

    task = make_task("arithmetic", digits=args.digits, eval_size=args.eval_size, seed=args.seed)
    tokenizer = build_tokenizer()
    config = build_config(tokenizer, args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads,
                          args.intermediate_size, args.max_position_embeddings)
    longest = len(encode_prompt(tokenizer, task.prompt({"question": f"What is {'9' * args.digits} + {'9' * args.digits}?"})))
    if longest + args.eval_max_new_tokens > config.max_position_embeddings:
        raise SystemExit(f"--max-position-embeddings {config.max_position_embeddings} is too small for {args.digits}-digit "
                         f"prompts ({longest} tokens) plus {args.eval_max_new_tokens} new tokens")
    model = build_model(config, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[toy] {n_params / 1e6:.2f}M-parameter Llama ({args.num_layers} layers, hidden {args.hidden_size}), "
          f"vocabulary {len(tokenizer)}; {args.digits}-digit addition, prompt {longest} tokens; {args.steps} steps of "
          f"{args.batch_size} on {torch.get_num_threads()} threads", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    model.train()
    history, t0 = [], time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate * min(1.0, (step + 1) / max(1, args.warmup_steps))
        loss = supervised_step(model, optimizer, supervised_batch(task, tokenizer, task.train_rows(step, args.batch_size)),
                               args.max_grad_norm)
        done = step + 1
        if done % 50 == 0 or done == args.steps:
            print(f"[toy] step {done}/{args.steps} loss {loss:.4f} ({time.perf_counter() - t0:.1f}s)", flush=True)
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            acc = greedy_accuracy(model, tokenizer, task, args.eval_max_new_tokens)
            history.append({"step": done, "eval_accuracy": acc})
            print(f"[toy] step {done}: greedy eval accuracy {acc:.3f}", flush=True)
    train_seconds = time.perf_counter() - t0  # includes any --eval-every evaluations

    t1 = time.perf_counter()
    accuracy = greedy_accuracy(model, tokenizer, task, args.eval_max_new_tokens)
    eval_seconds = time.perf_counter() - t1
    manifest = {
        "task": "arithmetic", "digits": args.digits, "steps": args.steps, "warm_start_seconds": round(train_seconds, 2),
        "eval_seconds": round(eval_seconds, 2), "eval_accuracy": accuracy, "eval_size": len(task.eval_rows),
        "eval_decoding": f"greedy, bf16 autocast, {args.eval_max_new_tokens} new tokens", "final_loss": loss if args.steps else None,
        "num_parameters": n_params, "vocab_size": len(tokenizer), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "history": history, "args": asdict(args),
    }
    out = save(model, tokenizer, manifest, out, args.overwrite)
    print(f"[toy] warm start {train_seconds:.1f}s; greedy eval accuracy {accuracy:.3f} on {len(task.eval_rows)} held-out "
          f"{args.digits}-digit problems ({eval_seconds:.1f}s)", flush=True)
    print(f"[toy] saved {out}\n[toy] use it with: python algorithms/grpo.py --model {out} --digits {args.digits}", flush=True)
