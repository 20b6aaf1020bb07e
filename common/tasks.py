"""Tasks: prompts, a training stream, a held-out eval set and a verifier.

* ``arithmetic`` (default): procedurally generated integer addition, seeded, endless; the eval
  set is fixed and excluded from the training stream. ``digits`` is the difficulty knob.
* ``gsm8k``: grade-school math, from the hub (``openai/gsm8k``, needs ``datasets``) or from a local
  folder holding ``train.jsonl`` and ``test.jsonl`` with ``question``/``answer`` fields.
"""

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TASKS = ("arithmetic", "gsm8k")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalise_number(s: str) -> str | None:
    s = s.replace(",", "").strip().rstrip(".")
    try:
        x = float(s)
    except ValueError:
        return None
    return str(int(x)) if x == int(x) else repr(x)


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), normalised; None if there is none."""
    found = _NUMBER.findall(text)
    return _normalise_number(found[-1]) if found else None


def extract_hash_answer(text: str) -> str | None:
    """The number after the last '####' (GSM8K's answer format); None if absent."""
    if "####" not in text:
        return None
    found = _NUMBER.findall(text.rsplit("####", 1)[1])
    return _normalise_number(found[0]) if found else None


def correctness_reward(answer: str | None, gold: str) -> float:
    """1.0 if the extracted answer equals the gold answer numerically, else 0.0."""
    return float(answer is not None and answer == _normalise_number(gold))


@dataclass
class Task:
    """A task: ``train_rows(k, n)`` gives the n rows of training batch k, ``eval_rows`` is fixed."""

    name: str
    eval_rows: list[dict]
    train_rows: Callable[[int, int], list[dict]]
    prompt: Callable[[dict], str]
    reward: Callable[[str, dict], float]
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------- arithmetic
def arithmetic_problem(rng: random.Random, digits: int) -> dict:
    """One addition problem with operands of exactly ``digits`` digits."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"question": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b}


def make_arithmetic_task(digits: int = 2, eval_size: int = 200, seed: int = 1) -> Task:
    if digits < 1:
        raise SystemExit(f"--digits must be >= 1, got {digits}")
    erng = random.Random(f"arithmetic-eval-{digits}")  # fixed whatever the training seed
    eval_rows, seen = [], set()
    space = (10**digits - (10 ** (digits - 1) if digits > 1 else 0)) ** 2
    if eval_size > space // 2:
        raise SystemExit(f"--eval-size {eval_size} is too large for {digits}-digit problems ({space} exist)")
    while len(eval_rows) < eval_size:
        row = arithmetic_problem(erng, digits)
        if (row["a"], row["b"]) not in seen:
            seen.add((row["a"], row["b"]))
            eval_rows.append(row)

    def train_rows(k: int, n: int) -> list[dict]:
        rng = random.Random(f"arithmetic-train-{seed}-{digits}-{k}")
        rows = []
        while len(rows) < n:
            row = arithmetic_problem(rng, digits)
            if (row["a"], row["b"]) not in seen:  # never train on a held-out problem
                rows.append(row)
        return rows

    return Task(
        name="arithmetic",
        eval_rows=eval_rows,
        train_rows=train_rows,
        prompt=lambda row: f"{row['question']} Reply with just the number.",
        reward=lambda text, row: correctness_reward(extract_last_number(text), row["answer"]),
        info={"digits": digits},
    )


# ---------------------------------------------------------------- gsm8k
def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    """Read a jsonl file; every row must be a JSON object with the ``required`` string fields."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: row {i} is not valid JSON ({e.msg}).") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}: row {i} is not a JSON object.")
            for key in required:
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise SystemExit(f"{path}: row {i} lacks a non-empty string field '{key}' "
                                     f"(fields present: {sorted(row)}).")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows.")
    return rows


def gsm8k_gold(row: dict, where: str) -> dict:
    gold = extract_hash_answer(row["answer"])
    if gold is None:
        raise SystemExit(f"{where}: answer does not end with '#### <number>': {row['answer'][-80:]!r}")
    return {"question": row["question"], "answer": gold}


def load_gsm8k_split(split: str, data_path: str | None) -> list[dict]:
    if data_path:
        path = Path(data_path)
        file = path / f"{split}.jsonl" if path.is_dir() else path
        if not file.is_file():
            raise SystemExit(f"--data-path {data_path}: expected a folder with {split}.jsonl (or a jsonl file).")
        raw = read_jsonl(file, ("question", "answer"))
        return [gsm8k_gold(r, f"{file}: row {i}") for i, r in enumerate(raw, 1)]
    try:
        import datasets
    except ImportError:
        raise SystemExit("--task gsm8k from the hub needs `pip install datasets`; or pass --data-path "
                         "<folder with train.jsonl and test.jsonl>.") from None
    ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    return [gsm8k_gold(r, f"openai/gsm8k[{split}] row {i}") for i, r in enumerate(ds, 1)]


def make_gsm8k_task(data_path: str | None = None, eval_size: int = 200, seed: int = 1) -> Task:
    train = load_gsm8k_split("train", data_path)
    test = load_gsm8k_split("test", data_path)
    eval_rows = test[:eval_size] if eval_size > 0 else test

    orders: dict[int, list[int]] = {}

    def train_rows(k: int, n: int) -> list[dict]:
        # an endless stream of reshuffled epochs; batch k is rows k*n .. k*n+n-1 of that stream
        out = []
        for j in range(k * n, k * n + n):
            epoch, i = divmod(j, len(train))
            if epoch not in orders:
                orders[epoch] = list(range(len(train)))
                random.Random(f"gsm8k-{seed}-{epoch}").shuffle(orders[epoch])
            out.append(train[orders[epoch][i]])
        return out

    return Task(
        name="gsm8k",
        eval_rows=eval_rows,
        train_rows=train_rows,
        prompt=lambda row: f"{row['question']} Let's think step by step and output the final answer after \"####\".",
        reward=lambda text, row: correctness_reward(extract_hash_answer(text), row["answer"]),
        info={"train_size": len(train), "test_size": len(test)},
    )


def make_task(name: str, *, digits: int = 2, data_path: str | None = None, eval_size: int = 200,
              seed: int = 1) -> Task:
    """Build a task by name; an unknown name is an error that lists the known ones."""
    if name == "arithmetic":
        return make_arithmetic_task(digits, eval_size, seed)
    if name == "gsm8k":
        return make_gsm8k_task(data_path, eval_size, seed)
    raise SystemExit(f"--task {name!r} is unknown; choose one of {', '.join(TASKS)}.")


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt: the chat template with a generation prompt (instruct models), or raw text."""
    if chat_template:
        if tokenizer.chat_template is None:
            raise SystemExit("this tokenizer has no chat template; pass --no-chat-template.")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]
