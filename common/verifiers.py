"""Answer extraction and checking for math RL, independent of the training algorithm.

Every verifier is a pure function ``check(response_text, gold_answer) -> bool``, registered by name in
``VERIFIERS`` (``check_answer(name, text, gold)`` looks one up and calls it):

* ``last_number``: the last number anywhere in the response (thousands separators removed, ints as
  ``"12"``, other floats via ``repr``) compared as a string with the normalised gold. This is the
  verifier of this project's default ``arithmetic`` task, which stands in for the papers' math
  benchmarks on CPU (docs/grpo.md, docs/dapo.md, docs/m2po.md, docs/ppo_stale.md).
* ``hash``: the first number after the last ``####``, GSM8K's answer format (Cobbe et al. 2021,
  "Training Verifiers to Solve Math Word Problems"); used by the ``gsm8k`` task.
* ``answer_line``: DAPO (Yu et al. 2025, "DAPO: an Open-Source LLM Reinforcement Learning System at
  Scale") trains on DAPO-Math-17k, whose prompts ask for a final line ``Answer: <answer>``. Its
  verifier reads only the last 300 characters of the response, takes the last ``Answer:`` line, applies
  the Minerva-style normalisation of ``normalize_final_answer`` (Lewkowycz et al. 2022) to it and to
  the gold, and compares the two *strings*. There is no symbolic step: ``0.5`` and ``\\frac{1}{2}`` are
  different answers under this verifier, faithfully to the DAPO release.
* ``boxed``: the content of the last ``\\boxed{...}`` (the MATH dataset's convention, Hendrycks et al.
  2021) checked for mathematical equivalence with HuggingFace's ``math_verify`` (``math_equal``), the
  verifier named by M2PO (docs/m2po.md): fractions, decimals, ``\\dfrac``, intervals, sets, units in
  ``\\text{}``, percentages and multiple-choice letters are compared after parsing into sympy.

A number a float cannot hold (400 digits, "inf", "nan") is no number: None, never an exception in the
reward thread. All functions are pure. ``math_verify`` is imported on first use of the "boxed" verifier,
with its signal-based timeouts off, so that rewards can be computed in a producer thread.
"""

import math
import re
from typing import Callable

# ---------------------------------------------------------------- numbers (last_number, hash)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise_number(s: str) -> str | None:
    """``s`` as a canonical number string ("1,000." -> "1000", "3.50" -> "3.5"); None if not a number."""
    s = s.replace(",", "").strip().rstrip(".")
    try:
        x = float(s)
    except ValueError:
        return None
    if not math.isfinite(x):  # "inf", "nan", or 400 digits that overflow a float: no usable number
        return None
    return str(int(x)) if x == int(x) else repr(x)


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), normalised; None if there is none."""
    found = _NUMBER.findall(text)
    return normalise_number(found[-1]) if found else None


def extract_hash_answer(text: str) -> str | None:
    """The number after the last '####' (GSM8K's answer format), normalised; None if absent."""
    if "####" not in text:
        return None
    found = _NUMBER.findall(text.rsplit("####", 1)[1])
    return normalise_number(found[0]) if found else None


# ---------------------------------------------------------------- DAPO: "Answer:" line, string match
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_ANSWER_WINDOW = 300  # DAPO only looks at the tail of the response

# Applied in order with str.replace, then every removal below; the lists are the DAPO release's.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVALS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# Wrappers whose content is kept: the first closing brace ends \text/\textbf/\overline (lazy, so
# "\text{\frac{1}{2}}" loses a brace, as in the release); \boxed keeps everything up to the last brace.
_UNWRAP = (
    re.compile(r"\\text\{(.*?)\}"),
    re.compile(r"\\textbf\{(.*?)\}"),
    re.compile(r"\\overline\{(.*?)\}"),
    re.compile(r"\\boxed\{(.*)\}"),
)
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")  # \frac12 -> \frac{1}{2}
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")  # \sqrt2 -> \sqrt{2}


def extract_answer_line(text: str) -> str | None:
    """What follows the last "Answer:" (any case) within the last 300 characters of ``text``; None if absent."""
    found = _ANSWER_LINE.findall(text[-_ANSWER_WINDOW:])
    return found[-1] if found else None


def _first_dollar_pair(line: str) -> str:
    """``$x$`` for the first ``$x$`` of a line holding two or more '$', else the line unchanged."""
    parts = line.split("$")
    return f"${parts[1]}$" if len(parts) >= 3 else line


def normalize_final_answer(s: str) -> str:
    """DAPO's (Minerva-style) normalisation of a final answer before string comparison."""
    s = s.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        s = s.replace(old, new)
    for junk in _REMOVALS:
        s = s.replace(junk, "")
    # keep only the first $...$ of each line (the release's regex has no DOTALL: it works line by line)
    s = "\n".join(_first_dollar_pair(line) for line in s.split("\n"))
    for wrapper in _UNWRAP:
        s = wrapper.sub(r"\1", s)
    s = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORTHAND.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


# ---------------------------------------------------------------- \boxed{} + math_verify
_BOX_COMMANDS = re.compile(r"\\(?:boxed|fbox)")
_SPACE_FORM_END = re.compile(r"[$\s]")


def _box_content(text: str, start: int) -> str | None:
    """Argument of a box command whose name ends at ``text[start]``; None if unbalanced or empty."""
    rest = text[start:].lstrip()
    if rest.startswith("{"):  # \boxed{...} (or \boxed {...}): count braces to the matching one
        depth = 0
        for i, ch in enumerate(rest):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return rest[1:i]
        return None  # unbalanced, e.g. a response truncated inside the box
    end = _SPACE_FORM_END.search(rest)  # "\boxed 5": up to the next '$' or whitespace
    content = rest[: end.start()] if end else rest
    return content or None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{..}``/``\\fbox{..}``/``\\boxed 5``, braces counted; None if absent/unbalanced."""
    for m in reversed(list(_BOX_COMMANDS.finditer(text))):
        nxt = text[m.end() : m.end() + 1]
        if nxt == "{" or (nxt and nxt.isspace()):
            return _box_content(text, m.end())
        # "\boxedfoo" or a bare "\boxed" at the very end is not a box: look further left
    return None


def _math_verify():
    """math_verify's parse and verify (imported on first use: it pulls in sympy)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise SystemExit(
            "the 'boxed' verifier needs math_verify: `pip install \"math-verify[antlr4_13_2]\"` "
            "(a dependency of this project; reinstall it with `pip install -e .`)."
        ) from None
    return parse, verify


def _mv_parse(parse, x: str) -> list:
    """math_verify's parse of ``x`` as a boxed expression, falling back to inline math ($x$); [] on failure."""
    for wrapped in ("\\boxed{" + x + "}", "$" + x + "$"):
        try:
            # parsing_timeout=None: math_verify's timeout is signal.alarm, which raises ValueError outside
            # the main thread, and our rewards are computed in the producer thread. Nothing then bounds a
            # pathological sympy parse; the inputs are single short answers, which parse in milliseconds.
            found = parse(wrapped, parsing_timeout=None)
        except Exception:  # whatever math_verify/sympy raises on odd input means "not parsable"
            found = []
        if found:
            return found
    return []


def math_equal(pred: str, gold: str) -> bool:
    """Whether ``pred`` and ``gold`` (LaTeX answer strings, no surrounding $) are equivalent per math_verify."""
    if not pred.strip() or not gold.strip():
        return False
    parse, verify = _math_verify()
    gold_parsed, pred_parsed = _mv_parse(parse, gold), _mv_parse(parse, pred)
    if not gold_parsed or not pred_parsed:
        return False
    try:
        # timeout_seconds=None for the same reason as parsing_timeout=None (signal.alarm, producer thread);
        # verify is not symmetric: the gold goes first
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # a comparison math_verify/sympy cannot make is a wrong answer, not a crash
        return False


# ---------------------------------------------------------------- registry
def _check_last_number(text: str, gold: str) -> bool:
    pred = extract_last_number(text)
    return pred is not None and pred == normalise_number(gold)


def _check_hash(text: str, gold: str) -> bool:
    pred = extract_hash_answer(text)
    return pred is not None and pred == normalise_number(gold)


def _check_answer_line(text: str, gold: str) -> bool:
    pred = extract_answer_line(text)
    return pred is not None and normalize_final_answer(pred) == normalize_final_answer(gold)


def _check_boxed(text: str, gold: str) -> bool:
    pred = last_boxed(text)
    return pred is not None and math_equal(pred, gold)


VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "last_number": _check_last_number,
    "hash": _check_hash,
    "answer_line": _check_answer_line,
    "boxed": _check_boxed,
}


def check_answer(verifier: str, text: str, gold: str) -> bool:
    """``VERIFIERS[verifier](text, gold)``; an unknown verifier name is an error listing the known ones."""
    if verifier not in VERIFIERS:
        raise SystemExit(f"verifier {verifier!r} is unknown; choose one of {', '.join(VERIFIERS)}.")
    return VERIFIERS[verifier](text, gold)
