"""common/verifiers.py: every verifier on (response, gold, expected) tables, and the extraction helpers.

Each expected value is what the paper's verifier gives for that row: string matching after
normalisation for "answer_line" (DAPO), math_verify equivalence for "boxed" (M2PO). Rows where that
disagrees with a reader's intuition say so in a comment.
"""

import threading

import pytest

from common.verifiers import (
    VERIFIERS,
    check_answer,
    extract_answer_line,
    extract_hash_answer,
    extract_last_number,
    last_boxed,
    math_equal,
    normalise_number,
    normalize_final_answer,
)

FILLER = "Let me double-check the arithmetic once more. " * 8  # 368 characters, no digits


# ------------------------------------------------------------------ last_number
@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("The answer is 42.", "42", True),
        ("12 + 30 = 42", "42", True),
        ("12 + 30 = 42", "12", False),  # only the last number counts
        ("I counted 1,000 apples", "1000", True),  # thousands separator in the response
        ("I counted 1000 apples", "1,000", True),  # ... or in the gold
        ("so x = -7", "-7", True),
        ("so x = 7", "-7", False),
        ("costs 3.50", "3.5", True),
        ("exactly 2.0", "2", True),
        ("5 cm", "5", True),
        ("\\frac{1}{2}", "0.5", False),  # the last number is 2: no fractions here
        ("no digits here", "5", False),
        ("", "0", False),
    ],
)
def test_last_number(text, gold, expected):
    assert VERIFIERS["last_number"](text, gold) is expected


# ------------------------------------------------------------------ hash (GSM8K "####")
@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("She has 8 + 64 = 72 eggs.\n#### 72", "72", True),
        ("#### 1,234", "1234", True),
        ("#### -3", "-3", True),
        ("#### $18.00", "18", True),
        ("#### 18 dollars, not 20", "18", True),  # the first number after the marker
        ("#### 5\nwait, no.\n#### 6", "6", True),  # the last marker counts
        ("#### 5\nwait, no.\n#### 6", "5", False),
        ("The answer is 72", "72", False),  # no marker: wrong even with the right number
        ("####", "5", False),
        ("#### five", "5", False),
    ],
)
def test_hash(text, gold, expected):
    assert VERIFIERS["hash"](text, gold) is expected


# ------------------------------------------------------------------ answer_line (DAPO)
@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("Step 1 ...\nAnswer: 42", "42", True),
        ("answer: 42", "42", True),  # case-insensitive
        ("ANSWER :   42", "42", True),
        ("Answer: -7", "-7", True),
        ("Answer: 7", "-7", False),
        ("Answer: 3\nOn reflection:\nAnswer: 4", "4", True),  # the last line counts
        ("Answer: 3\nOn reflection:\nAnswer: 4", "3", False),
        ("Answer: x = 5", "5", True),  # the part after the last '='
        ("Answer: $5$", "5", True),
        ("Answer: \\boxed{7}", "7", True),
        ("Answer: 5 cm", "5", True),  # unit words are removed
        ("Answer: 5\\text{ cm}", "5", True),
        ("Answer: 90^\\circ", "90", True),
        ("Answer: 1,000", "1000", True),
        ("Answer: (-\\infty, 3]", "(-\\infty,3]", True),  # spaces are removed
        ("Answer: (-\\infty, 3)", "(-\\infty,3]", False),
        ("Answer: \\frac12", "\\frac{1}{2}", True),  # shorthand is expanded
        ("Answer: 10\\%", "10\\%", True),
        ("Answer: B", "B", True),
        # string matching, faithfully to DAPO: equivalent values written differently are wrong
        ("Answer: \\frac{1}{2}", "0.5", False),
        ("Answer: 1/2", "\\frac{1}{2}", False),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False),
        ("Answer: 10\\%", "10", False),
        ("Answer: (B)", "B", False),
        ("The final answer is 42", "42", False),  # no "Answer:" line
        ("Answer: 42\n" + FILLER, "42", False),  # outside the last 300 characters
        ("", "42", False),
    ],
)
def test_answer_line(text, gold, expected):
    assert VERIFIERS["answer_line"](text, gold) is expected


# ------------------------------------------------------------------ boxed (math_verify)
@pytest.mark.parametrize(
    "text,gold,expected",
    [
        ("so the answer is $\\boxed{42}$.", "42", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),  # equivalent values are equal
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{1/2}", "\\frac{1}{2}", True),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac12}", "0.5", True),
        ("\\boxed{0.33}", "\\frac{1}{3}", False),  # rounded too coarsely
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),  # nested braces, symbolic equality
        ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", True),
        ("\\boxed{5\\text{ cm}}", "5", True),  # units in \text{} are dropped
        ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", True),
        ("\\boxed{(-\\infty,3)}", "(-\\infty,3]", False),  # open vs closed end
        ("\\boxed{\\{3, 2\\}}", "\\{2,3\\}", True),  # sets ignore order
        ("first \\boxed{3}, but finally \\boxed{4}", "4", True),  # only the last box counts
        ("first \\boxed{3}, but finally \\boxed{4}", "3", False),
        ("\\boxed{1,000}", "1000", True),  # thousands separator, not the set {1, 0}
        ("\\boxed{1000}", "1,000", True),
        ("\\boxed{-3}", "-3", True),
        ("\\boxed{3}", "-3", False),
        ("\\boxed{x = 5}", "5", True),  # math_verify compares the right-hand side
        ("\\boxed{10\\%}", "10\\%", True),
        ("\\boxed{0.1}", "10\\%", True),
        # math_verify also accepts the bare number for a percentage gold (it tries the gold without '%');
        # surprising, but it is what M2PO's verifier does, so the row documents it
        ("\\boxed{10}", "10\\%", True),
        ("\\boxed{\\text{(B)}}", "\\text{(B)}", True),  # multiple choice
        ("\\boxed{B}", "\\text{(B)}", True),
        ("\\boxed{(B)}", "B", True),
        ("\\boxed{A}", "B", False),
        ("\\fbox{7}", "7", True),
        ("$\\boxed 7$", "7", True),
        ("The answer is 5", "5", False),  # no box at all
        ("\\boxed{}", "5", False),
        ("\\boxed{\\frac{1}{2", "0.5", False),  # truncated inside the box
        ("", "5", False),
    ],
)
def test_boxed(text, gold, expected):
    assert VERIFIERS["boxed"](text, gold) is expected


@pytest.mark.parametrize("pred", ["\\frac{1}{2}", "0.5", "1/2", "\\dfrac{1}{2}"])
def test_equivalent_forms_boxed_accepts_answer_line_only_verbatim(pred):
    assert check_answer("boxed", f"\\boxed{{{pred}}}", "\\frac{1}{2}")
    assert check_answer("answer_line", f"Answer: {pred}", "\\frac{1}{2}") is (pred == "\\frac{1}{2}")


# ------------------------------------------------------------------ last_boxed
@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{5}", "5"),
        ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{\\sqrt{2}}{2}"),  # nested braces
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("\\boxed{1} and \\boxed{2}", "2"),
        ("\\fbox{1} and \\boxed{2}", "2"),
        ("\\boxed{2} and \\fbox{1}", "1"),
        ("\\boxed {x+1}", "x+1"),
        ("$\\boxed 5$", "5"),  # space form: up to the next '$' ...
        ("\\boxed 5 apples", "5"),  # ... or whitespace
        ("\\boxed 5", "5"),
        ("\\boxed{3} then \\boxedtext", "3"),  # "\boxedtext" is not a box
        ("\\boxed{}", ""),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced: the last box is never closed
        ("\\boxed{1} then \\boxed{2", None),  # ... and an earlier box does not stand in
        ("\\boxed", None),
        ("\\boxed $", None),
        ("the answer is 5", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


# ------------------------------------------------------------------ normalize_final_answer
@pytest.mark.parametrize(
    "s,expected",
    [
        ("42", "42"),
        (" 42 ", "42"),
        ("x = 5", "5"),
        ("y = 2x = 10", "10"),  # after the last '='
        ("$5$", "5"),
        ("$5$ or $6$", "5"),  # only the first $...$ pair is kept
        ("\\$12", "12"),
        ("12 dollars", "12"),
        ("5 \\text{ cm}", "5"),
        ("5\\text{ m}", "5"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("1,000", "1000"),
        ("1,000,000", "1000000"),
        ("(1, 2)", "(1,2)"),  # commas stay when it is not a plain number
        ("\\text{(B)}", "(B)"),
        ("\\textbf{C}", "C"),
        ("\\overline{3}", "3"),
        ("\\boxed{7}", "7"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac34", "\\dfrac{3}{4}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("(-\\infty, 3]", "(-\\infty,3]"),
        ("an apple", "apple"),
        ("x\\in\\{1,2,\\ldots\\}", "x\\in\\{1,2,\\}"),
        # quirks of the release, kept: "1,2" reads as the number 12, and \text{} ends at its first '}'
        ("1,2", "12"),
        ("\\text{\\frac{1}{2}}", "\\frac{1{2}}"),
    ],
)
def test_normalize_final_answer(s, expected):
    assert normalize_final_answer(s) == expected


# ------------------------------------------------------------------ extract_answer_line
def test_extract_answer_line():
    assert extract_answer_line("reasoning\nAnswer: 7") == "7"
    assert extract_answer_line("ANSWER:7") == "7"
    assert extract_answer_line("answer :  7 apples\nthanks") == "7 apples"  # the rest of the line
    assert extract_answer_line("Answer: 1\nAnswer: 2\n") == "2"
    assert extract_answer_line("Answer: 7\n8") == "7"  # the capture stops at the line's end ...
    assert extract_answer_line("Answer:\n7") == "7"  # ... but \s* before it may cross one (DAPO's regex)
    assert extract_answer_line("the answer is 7") is None
    assert extract_answer_line("") is None


def test_extract_answer_line_window():
    inside = "Answer: 7\n" + "x" * 290  # 300 characters: "Answer" is the first
    assert len(inside) == 300 and extract_answer_line(inside) == "7"
    assert extract_answer_line(inside + "x") is None  # 301: the window starts at "nswer"
    assert extract_answer_line("Answer: 3\n" + FILLER + "\nAnswer: 4") == "4"


# ------------------------------------------------------------------ numbers
@pytest.mark.parametrize(
    "text,last,hashed",
    [
        ("The answer is 42.", "42", None),
        ("1,234 apples", "1234", None),
        ("-7", "-7", None),
        ("3.50", "3.5", None),
        ("2.0", "2", None),
        ("x #### 1,000.", "1000", "1000"),
        ("#### 4 then 5", "5", "4"),
        ("no digits here", None, None),
        ("", None, None),
    ],
)
def test_number_extraction(text, last, hashed):
    assert extract_last_number(text) == last
    assert extract_hash_answer(text) == hashed


def test_normalise_number():
    assert normalise_number("1,000.") == "1000"
    assert normalise_number(" 0.25 ") == "0.25"
    assert normalise_number("-0.0") == "0"
    assert normalise_number("abc") is None
    assert normalise_number("") is None
    # a float overflow is not a number (the response "999...9" must score 0, not crash the reward)
    assert normalise_number("9" * 400) is None
    assert extract_last_number("9" * 400) is None
    assert not check_answer("last_number", "9" * 400, "1")


# ------------------------------------------------------------------ math_equal
def test_math_equal_edge_cases():
    assert math_equal("\\frac{1}{2}", "0.5")
    assert not math_equal("", "5")
    assert not math_equal("   ", "5")
    assert not math_equal("5", "")
    with pytest.raises(AttributeError):  # a caller's bug is not a wrong answer
        math_equal(None, "5")  # type: ignore[arg-type]


def test_math_equal_library_errors_are_false(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(math_verify, "verify", broken)
    assert not math_equal("1", "1")
    monkeypatch.setattr(math_verify, "parse", broken)
    assert not math_equal("1", "1")


def _in_thread(fn, *args):
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised in the main thread below
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_math_equal_in_a_thread():
    # the producer-thread case: math_verify's signal-based timeouts are off, so this works off the main thread
    assert _in_thread(math_equal, "\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}") is True
    assert _in_thread(math_equal, "(-\\infty,3)", "(-\\infty,3]") is False
    assert _in_thread(check_answer, "boxed", "so \\boxed{0.5}", "\\frac{1}{2}") is True


def test_boxed_verifier_asks_math_verify_for_no_signal_timeout(monkeypatch):
    """Our contract for the producer thread, whatever math_verify's defaults: every parse and verify call passes
    parsing_timeout=None / timeout_seconds=None (its timeouts are signal.alarm, main thread only). A strict stand-in
    that refuses any timeout off the main thread leaves the rewards unchanged there."""
    import math_verify

    calls = []

    def strict(real, timeout_kwarg):
        def call(*args, **kwargs):
            calls.append(kwargs.get(timeout_kwarg, "default"))
            if calls[-1] is not None and threading.current_thread() is not threading.main_thread():
                raise ValueError(f"{timeout_kwarg}={calls[-1]!r} needs the main thread")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(math_verify, "parse", strict(math_verify.parse, "parsing_timeout"))
    monkeypatch.setattr(math_verify, "verify", strict(math_verify.verify, "timeout_seconds"))
    assert _in_thread(check_answer, "boxed", "so \\boxed{0.5}", "\\frac{1}{2}") is True
    assert _in_thread(check_answer, "boxed", "so \\boxed{0.4}", "\\frac{1}{2}") is False
    assert _in_thread(math_equal, "\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}") is True
    assert len(calls) >= 6 and all(timeout is None for timeout in calls), calls


# ------------------------------------------------------------------ registry
def test_verifier_names():
    assert sorted(VERIFIERS) == ["answer_line", "boxed", "hash", "last_number"]
    assert check_answer("hash", "#### 3", "3") and not check_answer("last_number", "3 or 4", "3")


def test_check_answer_unknown_name():
    with pytest.raises(SystemExit) as err:
        check_answer("minerva", "Answer: 1", "1")
    message = str(err.value)
    assert "'minerva'" in message
    assert all(name in message for name in VERIFIERS)
