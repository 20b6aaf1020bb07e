"""Tasks: where the problems come from, how they are put to the model and how answers are checked.

A ``Task`` has an endless training stream (``train_rows(k, n)``: the n rows of batch k), a fixed held-out
eval set, a prompt template (text, and whether the chat template applies) and ``reward(text, row)``: 1.0
if the answer is correct, else 0.0 (an algorithm that defines rewards otherwise, e.g. DAPO's +1/-1, maps
correctness itself).

Training tasks (``--task``): ``arithmetic`` (procedural addition, the default), ``chain`` (procedural chained
addition and subtraction worked one operation per line: multi-step answers of varied length), ``gsm8k``, ``math`` (MATH
train), ``deepscaler`` (DeepScaleR-Preview) and ``dapo17k`` (DAPO-Math-17k). Eval benchmarks
(``--eval-task``): ``gsm8k`` (test), ``math500``, ``aime24``, ``amc23``, ``minerva``, ``olympiadbench``.
Each loads from its hub name (``datasets``) or from a local json / jsonl / parquet file or a folder with
``train.*`` / ``test.*``. Rows are read leniently across the published schemas (question from ``problem`` /
``question`` / ``prompt``; answer from ``answer`` / ``final_answer`` / ``reward_model.ground_truth``, or the
last ``\\boxed{}`` of ``solution``) and strictly otherwise: a missing field or malformed row is an error
naming the file and row.

Prompt templates (``--prompt-template``), each with the verifier its paper used (common/verifiers.py):
``number`` (arithmetic: last number), ``chain`` (chain: one operation per line, then "####"), ``grpo`` ("####"),
``dapo`` ("Answer:" line), ``m2po`` (last ``\\boxed{}`` + math_verify), ``tba`` (raw text, last number),
``vineppo`` (raw text, "####").
"""

import json
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from common.verifiers import check_answer, extract_hash_answer, last_boxed, normalise_number

# re-exported for the tests (tests/test_common.py imports it from here)
from common.verifiers import extract_last_number as extract_last_number

# name: (hub id, config, split)
TRAIN_SETS = {
    "gsm8k": ("openai/gsm8k", "main", "train"),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "train"),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, "train"),
    "dapo17k": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
}
BENCHMARKS = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "amc23": ("math-ai/amc23", None, "test"),
    "minerva": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("math-ai/olympiadbench", None, "test"),
}
TASKS = ("arithmetic", "chain", *TRAIN_SETS)
DEFAULT_EVAL = {"gsm8k": "gsm8k", "math": "math500", "deepscaler": "math500", "dapo17k": "math500"}

_DAPO_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'
# name: (text with {question}, chat template?, verifier) -- the papers' prompts and verifiers (docs/tasks.md)
TEMPLATES = {
    "number": ("{question} Reply with just the number.", True, "last_number"),
    "chain": ("One step per line, then #### result.\n{question}\n", False, "hash"),
    "grpo": ('{question} Let\'s think step by step and output the final answer after "####".', True, "hash"),
    "dapo": (_DAPO_HEAD + "{question}" + _DAPO_TAIL, True, "answer_line"),
    "m2po": (
        "Please solve the following math problem: {question}. The assistant first thinks about the reasoning "
        "process step by step and then provides the user with the answer. Return the final answer in "
        "\\boxed{} tags, for example \\boxed{1}. Let's solve this step by step. ",
        True,
        "boxed",
    ),
    "tba": ("[MATH TASK] Problem:\n{question}\n\nSolution:\n", False, "last_number"),
    "vineppo": ("[MATH_TASK] Problem:\n{question}\n\nSolution:", False, "hash"),
}
DEFAULT_TEMPLATE = {
    "arithmetic": "number",
    "chain": "chain",
    "gsm8k": "grpo",
    "math": "m2po",
    "deepscaler": "m2po",
    "dapo17k": "dapo",
}


def correctness_reward(answer: str | None, gold: str) -> float:
    """1.0 if an extracted number equals the gold answer numerically, else 0.0."""
    return float(answer is not None and answer == normalise_number(gold))


@dataclass
class Task:
    """A task: ``train_rows(k, n)`` gives the n rows of training batch k, ``eval_rows`` is fixed."""

    name: str
    eval_rows: list[dict]
    train_rows: Callable[[int, int], list[dict]]
    prompt: Callable[[dict], str]
    reward: Callable[[str, dict], float]
    chat: bool = True
    info: dict = field(default_factory=dict)


def resolve_template(template: str) -> tuple[Callable[[dict], str], bool, str]:
    """(row -> prompt text, chat template?, verifier name) of a template; an unknown name lists the known ones."""
    if template not in TEMPLATES:
        raise SystemExit(f"--prompt-template {template!r} is unknown; choose one of auto, {', '.join(TEMPLATES)}.")
    text, chat, verifier = TEMPLATES[template]
    return (lambda row: text.replace("{question}", row["question"])), chat, verifier


def _apply_template(name: str, eval_rows: list[dict], train_rows, template: str, info: dict) -> Task:
    prompt, chat, verifier = resolve_template(template)
    return Task(
        name=name,
        eval_rows=eval_rows,
        train_rows=train_rows,
        prompt=prompt,
        reward=lambda response, row: float(check_answer(verifier, response, row["answer"])),
        chat=chat,
        info={**info, "prompt_template": template, "verifier": verifier},
    )


# ---------------------------------------------------------------- arithmetic
def arithmetic_problem(rng: random.Random, digits: int) -> dict:
    """One addition problem with operands of exactly ``digits`` digits."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"question": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b}


def make_arithmetic_task(digits: int = 2, eval_size: int = 200, seed: int = 1, template: str = "number") -> Task:
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

    return _apply_template("arithmetic", eval_rows, train_rows, template, {"digits": digits, "eval_task": "arithmetic"})


# ---------------------------------------------------------------- chain: multi-step arithmetic
# Why this task: its solutions are several newline-separated steps that each depend on the one before, so one wrong
# step makes the final answer wrong (step-level credit assignment has something to assign), and the number of
# steps varies several-fold between problems (long tails for asynchrony and overlong shaping to act on), while the
# problems stay procedural: unlimited, exactly checkable, and a held-out set that training never meets. The prompt is
# raw text ending with the expression on its own line, so the first step reads the line above it as every later
# step does (docs/tasks.md).
# operations per problem: n in [3, 14] with P(n) proportional to n^-1.5 (mean 6.1, median 5); at --digits 1 a worked
# solution is 10n + 6 characters, from 36 to 146
CHAIN_OPS = (3, 14)


def chain_problem(rng: random.Random, digits: int) -> dict:
    """A start value in [0, 10^digits - 1] followed by n additions or subtractions, each operand drawn so that the
    running value stays in that range (question "4 - 1 + 3 - 4"). ``solution`` works one operation per line
    ("4 - 1 = 3", "3 + 3 = 6", "6 - 4 = 2"), then "#### <result>"; ``answer`` is the result and ``steps`` is n."""
    top = 10**digits - 1
    ns = list(range(CHAIN_OPS[0], CHAIN_OPS[1] + 1))
    n = rng.choices(ns, weights=[k**-1.5 for k in ns])[0]
    value = rng.randint(0, top)
    terms, lines = [str(value)], []
    for _ in range(n):
        add = value == 0 or (value < top and rng.random() < 0.5)
        b = rng.randint(1, top - value) if add else rng.randint(1, value)
        new = value + b if add else value - b
        terms.append(f"{'+' if add else '-'} {b}")
        lines.append(f"{value} {terms[-1]} = {new}")
        value = new
    solution = "\n".join(lines + [f"#### {value}"])
    return {"question": " ".join(terms), "answer": str(value), "solution": solution, "steps": n}


def make_chain_task(digits: int = 1, eval_size: int = 200, seed: int = 1, template: str = "chain") -> Task:
    """Chained arithmetic (chain_problem) with a fixed held-out set of ``eval_size`` problems (the same for every
    training seed) that the training stream never yields."""
    if digits < 1:
        raise SystemExit(f"--digits must be >= 1, got {digits}")
    erng = random.Random(f"chain-eval-{digits}")
    eval_rows, seen = [], set()
    while len(eval_rows) < eval_size:
        row = chain_problem(erng, digits)
        if row["question"] not in seen:
            seen.add(row["question"])
            eval_rows.append(row)

    def train_rows(k: int, n: int) -> list[dict]:
        rng = random.Random(f"chain-train-{seed}-{digits}-{k}")
        rows = []
        while len(rows) < n:
            row = chain_problem(rng, digits)
            if row["question"] not in seen:  # never train on a held-out problem
                rows.append(row)
        return rows

    return _apply_template(
        "chain", eval_rows, train_rows, template, {"digits": digits, "eval_task": "chain", "ops": list(CHAIN_OPS)}
    )


# ---------------------------------------------------------------- datasets: reading rows
def read_rows(path: Path, flag: str = "") -> list[dict]:
    """Rows of a .jsonl, .json (a list of objects) or .parquet file; each row must be a JSON object."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading parquet needs `pip install pyarrow` (or convert it to jsonl).") from None
        rows = pq.read_table(path).to_pylist()
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: not valid JSON ({e.msg} at line {e.lineno}).") from None
        if not isinstance(rows, list):
            raise SystemExit(f"{path}: expected a JSON list of objects, got a {type(rows).__name__}.")
    elif suffix == ".jsonl":
        rows = []
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}: row {i} is not valid JSON ({e.msg}).") from None
    else:
        raise SystemExit(f"{path}: unknown file type {suffix!r}; expected .jsonl, .json or .parquet.")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SystemExit(f"{path}: row {i} is not a JSON object.")
    if not rows:
        raise SystemExit(
            f"{flag + ' ' if flag else ''}{path}: the file has no rows; pass a file with at least one question."
        )
    return rows


def _as_answer(value) -> str | None:
    """A gold answer as a string: numbers printed plainly (142.0 -> '142'), a list joined with ', '."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    if isinstance(value, str):
        value = value.strip()
        if len(value) > 1 and value[0] == value[-1] == "$":  # OlympiadBench writes '$2^{1009}$'
            value = value[1:-1].strip()
        return value or None
    if isinstance(value, (list, tuple)) and value:
        parts = [_as_answer(v) for v in value]
        return None if None in parts else ", ".join(parts)
    return None


def _question(row: dict) -> str | None:
    for key in ("problem", "question"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key].strip()
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # a chat (DAPO-Math-17k): the last user message
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if isinstance(prompt, str) and prompt.strip():
        q = prompt.strip()
        if q.startswith(_DAPO_HEAD.strip()) and q.endswith(_DAPO_TAIL.strip()):  # recover the bare problem
            q = q[len(_DAPO_HEAD.strip()) : -len(_DAPO_TAIL.strip())].strip()
        return q
    return None


def normalise_row(row: dict, where: str) -> dict:
    """{question, answer} from a row of any supported schema; an error naming ``where`` if a field is missing."""
    question = _question(row)
    if question is None:
        raise SystemExit(
            f"{where}: no question (looked for a non-empty 'problem', 'question' or 'prompt'; "
            f"fields present: {sorted(row)})."
        )
    answer = None
    for key in ("answer", "final_answer", "ground_truth"):
        if key in row:
            answer = _as_answer(row[key])
            if answer is None:
                raise SystemExit(f"{where}: field '{key}' is not a usable answer: {row[key]!r}.")
            break
    else:
        if isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
            answer = _as_answer(row["reward_model"]["ground_truth"])
        elif isinstance(row.get("solution"), str):
            answer = last_boxed(row["solution"])
        if answer is None:
            raise SystemExit(
                f"{where}: no answer (looked for 'answer', 'final_answer', 'ground_truth', "
                f"'reward_model.ground_truth' or a \\boxed{{}} in 'solution'; fields present: {sorted(row)})."
            )
    if "####" in answer:  # GSM8K: a worked solution ending in '#### <number>'
        gold = extract_hash_answer(answer)
        if gold is None:
            raise SystemExit(f"{where}: answer does not end with '#### <number>': {answer[-80:]!r}")
        answer = gold
    return {"question": question, "answer": answer}


def _split_file(folder: Path, split: str) -> Path | None:
    found = [
        folder / f"{split}{ext}" for ext in (".jsonl", ".json", ".parquet") if (folder / f"{split}{ext}").is_file()
    ]
    return found[0] if found else None


def hub_offline(timeout: float = 3.0) -> bool:
    """Whether the hub is out of reach: HF_HUB_OFFLINE is set, or its host (HF_ENDPOINT, default huggingface.co) takes
    no connection within ``timeout`` seconds. Behind a proxy (HTTPS_PROXY, ALL_PROXY) the hub counts as reachable."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
        return False
    except OSError:  # no name resolution, no route, refused, timed out
        return True


def load_rows(name: str, source: tuple, path: str | None, flag: str) -> list[dict]:
    """The {question, answer} rows of dataset ``name``: from ``path`` (a file, or a folder with <split>.jsonl/
    .json/.parquet) when given, else from the hub ``source`` = (hub id, config, split)."""
    hub, config, split = source
    if path:
        p = Path(path)
        file = _split_file(p, split) if p.is_dir() else p
        if file is None or not file.is_file():
            raise SystemExit(
                f"{flag} {path}: expected a folder with {split}.jsonl (or .json/.parquet), or such a file."
            )
        rows = read_rows(file, flag)
        return [normalise_row(r, f"{file}: row {i}") for i, r in enumerate(rows, 1)]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            f"{name} from the hub needs `pip install datasets`; or pass {flag} <a local json/jsonl/parquet copy>."
        ) from None
    import datasets.config
    import huggingface_hub.constants

    offline, saved = hub_offline(), (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    try:
        if offline:  # only a cached copy can load: ask for it alone, at once, not after the hub client's retries
            datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
        ds = datasets.load_dataset(hub, config, split=split) if config else datasets.load_dataset(hub, split=split)
    except Exception as e:  # offline, unknown revision, ...: say what to do instead
        why = "offline, and no cached copy" if offline else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise SystemExit(
            f"could not load {name} from the hub ({hub}, split {split}: {why}); pass {flag} <a local json/jsonl/"
            f"parquet copy> instead."
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
    return [normalise_row(r, f"{hub}[{split}] row {i}") for i, r in enumerate(ds, 1)]


def load_benchmark(name: str, path: str | None = None, flag: str = "--eval-data-path") -> list[dict]:
    """Every {question, answer} row of an eval benchmark (from ``path`` when given, else the hub)."""
    if name not in BENCHMARKS:
        raise SystemExit(f"benchmark {name!r} is unknown; choose one of {', '.join(BENCHMARKS)}.")
    return load_rows(name, BENCHMARKS[name], path, flag)


def check_numeric_answers(rows: list[dict], verifier: str, template: str, what: str) -> None:
    """A number-only verifier (last_number, hash) on LaTeX answers would score 0 silently: refuse it."""
    if verifier not in ("last_number", "hash"):
        return
    bad = [r["answer"] for r in rows if normalise_number(r["answer"]) is None]
    if bad:
        raise SystemExit(
            f"--prompt-template {template} checks a plain number ({verifier}), but {len(bad)} of "
            f"{len(rows)} {what} answers are not numbers (e.g. {bad[0]!r}); use --prompt-template "
            f"m2po (\\boxed{{}} + math_verify) or dapo."
        )


def make_task(
    name: str,
    *,
    digits: int = 2,
    data_path: str | None = None,
    eval_task: str | None = None,
    eval_data_path: str | None = None,
    eval_size: int = 200,
    prompt_template: str = "auto",
    seed: int = 1,
) -> Task:
    """Build a task by name; an unknown name, template or benchmark is an error that lists the known ones.

    ``eval_size`` > 0 keeps the first ``eval_size`` eval problems (0: all of them). Training problems whose
    text equals an eval problem's are dropped, so the held-out set stays held out. Without
    ``eval_data_path``, a local training copy laid out as ``train.*`` + ``test.*`` (a folder, or a file named
    ``train.*`` next to a ``test.*``) supplies the default benchmark's test split; else the hub does.
    """
    if name not in TASKS:
        raise SystemExit(f"--task {name!r} is unknown; choose one of {', '.join(TASKS)}.")
    template = DEFAULT_TEMPLATE[name] if prompt_template == "auto" else prompt_template
    verifier = resolve_template(template)[2]  # also rejects an unknown template before any data is read
    if name in ("arithmetic", "chain") and eval_size < 1:
        raise SystemExit(
            f"--eval-size {eval_size}: --task {name} generates its held-out problems, so there is no 'all of the "
            f"benchmark' (0 means that for a dataset's benchmark); pass --eval-size N >= 1 (the default is 200)"
        )
    if name == "arithmetic":
        if eval_task not in (None, "arithmetic") or eval_data_path or data_path:
            raise SystemExit(
                "--task arithmetic is generated: it takes no --data-path / --eval-data-path and "
                "evaluates on its own held-out problems (leave --eval-task unset)."
            )
        return make_arithmetic_task(digits, eval_size, seed, template)
    if name == "chain":
        if eval_task not in (None, "chain") or eval_data_path or data_path:
            raise SystemExit(
                "--task chain is generated: it takes no --data-path / --eval-data-path and evaluates on "
                "its own held-out problems (leave --eval-task unset)."
            )
        return make_chain_task(digits, eval_size, seed, template)
    eval_name = eval_task or DEFAULT_EVAL[name]
    if eval_name not in BENCHMARKS:
        raise SystemExit(f"--eval-task {eval_name!r} is unknown; choose one of {', '.join(BENCHMARKS)}.")
    train = load_rows(name, TRAIN_SETS[name], data_path, "--data-path")
    if eval_data_path is None and data_path and eval_name == DEFAULT_EVAL[name]:
        # a local copy laid out as <folder>/train.* + <folder>/test.*: its test split is the eval set
        given = Path(data_path)
        sibling = _split_file(given if given.is_dir() else given.parent, "test")
        if sibling is not None and (given.is_dir() or given.stem == "train"):
            eval_data_path = str(sibling)
    evals = load_benchmark(eval_name, eval_data_path)
    eval_rows = evals[:eval_size] if eval_size > 0 else evals
    check_numeric_answers(train, verifier, template, f"{name} training")
    check_numeric_answers(eval_rows, verifier, template, eval_name)
    held_out = {r["question"] for r in evals}
    kept = [r for r in train if r["question"] not in held_out]
    if not kept:
        raise SystemExit(f"every {name} training problem is also in the {eval_name} eval set; check --data-path.")
    orders: dict[int, list[int]] = {}

    def train_rows(k: int, n: int) -> list[dict]:
        # an endless stream of reshuffled epochs; batch k is rows k*n .. k*n+n-1 of that stream
        out = []
        for j in range(k * n, k * n + n):
            epoch, i = divmod(j, len(kept))
            if epoch not in orders:
                orders[epoch] = list(range(len(kept)))
                random.Random(f"{name}-{seed}-{epoch}").shuffle(orders[epoch])
            out.append(kept[orders[epoch][i]])
        return out

    info = {
        "train_size": len(kept),
        "train_dropped_as_eval": len(train) - len(kept),
        "eval_task": eval_name,
        "eval_size": len(eval_rows),
        "test_size": len(evals),
        "eval_source": eval_data_path or BENCHMARKS[eval_name][0],
    }
    return _apply_template(name, eval_rows, train_rows, template, info)


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt: the chat template with a generation prompt (instruct models), or raw text."""
    if chat_template:
        if tokenizer.chat_template is None:
            raise SystemExit(
                "this tokenizer has no chat template; pass --chat-template False (or a raw-text "
                "--prompt-template such as tba)."
            )
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]
