"""The docs against the repository (README.md, docs/*.md, reproduce/**/README.md): every file they name exists, every
dotted reference (``common/logprobs.response_logprobs``, ``common.logprobs.side_autocast``) names a top-level
definition of its module, every relative link and its #anchor resolve, every quoted section (README "Recipes", in the
docs and in the comments of the scripts) exists, and every ``--flag`` they give an algorithm script is one of that
script's arguments (read from its ``Args`` dataclass with ``ast``: the scripts are neither imported nor run)."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("grpo", "dapo", "ppo_stale", "m2po", "dppo", "tba", "vineppo")
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("reproduce/**/README.md")], key=str)
# files whose text or comments may name a section of a doc
SECTION_SOURCES = sorted(
    {*DOCS, *ROOT.glob("reproduce/**/*.sh"), *ROOT.glob("reproduce/**/*.py"), *ROOT.glob("algorithms/*.py")}
    | {*ROOT.glob("common/*.py")},
    key=str,
)

# A path named from the repository's root: not preceded by a path character (`../docs/x.md` and
# `my_project/experiments/m2po.py` are links or other folders, checked as links or not at all); placeholders such as
# `reproduce/<figure>/run.py` and globs such as `reproduce/*/plot.py` do not match.
PATH = re.compile(
    r"(?<![\w./<>*-])((?:common|algorithms)/\w+\.py|reproduce/[\w./-]*\w\.(?:py|sh|csv|png)|docs/\w+\.md"
    r"|tests/\w+\.py)(?![\w-])"
)
# `common/logprobs.response_logprobs`, `reproduce/sweep.paired_verdict`: a module file and a name in it
SLASH_DOTTED = re.compile(r"(?<![\w./<>*-])((?:common|algorithms|reproduce|tests)(?:/\w+)+)\.([A-Za-z_]\w*)\b")
# `common.logprobs.side_autocast` (the import path; the package is the only one the docs name this way)
MODULE_DOTTED = re.compile(r"(?<![\w./-])common\.(\w+)(?:\.([A-Za-z_]\w*))?\b")
FILE_EXTS = {"py", "sh", "md", "csv", "png", "json", "jsonl", "txt", "pt", "toml", "yaml", "yml", "gguf", "log"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# `README "Recipes"`, `docs/distributed.md, "Not yet run on GPUs"`: a section named by its (leading) title
SECTION_REF = re.compile(r"\b((?:docs/)?\w+\.md|README)[ ,:;]*[\"\u201c]([^\"\u201d]{3,80})[\"\u201d]")
SCRIPT = re.compile(r"(?:^|/)(\w+)\.(py|sh)$")
# programs whose flags are their own: flags after them, up to the next script path, are not an algorithm's
OTHER_PROGRAMS = {"torchrun", "python", "python3", "pip", "bash", "sh", "time", "ruff", "codespell", "pytest", "git"}
SHELL_SEPARATORS = {"&&", "||", "|", ";", "&"}
# Flags in backticks in docs/<algo>.md prose that name no script but belong to another tool (the doc's own script is
# the default there): (doc, flag) pairs, each with a comment saying whose flag it is. None so far: the docs name the
# tool in the same backticks (`torchrun --nproc-per-node 2`, `reproduce/eval/evaluate.py --n 32`).
OTHER_TOOL_FLAGS: frozenset[tuple[str, str]] = frozenset()


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(lines: list[str]) -> list[bool]:
    """For each line, whether it is inside a fenced code block (the fences included)."""
    inside, out = False, []
    for line in lines:
        fence = line.lstrip().startswith("```")
        out.append(inside or fence)
        if fence:
            inside = not inside
    return out


@cache
def top_level_names(module: Path) -> frozenset[str]:
    """The names a module defines at its top level: functions, classes and assigned names (not imports)."""
    tree = ast.parse(module.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


@cache
def script_flags(algo: str) -> frozenset[str]:
    """The flags of algorithms/<algo>.py, from its ``Args`` dataclass: a field foo_bar gives --foo-bar, a bool field
    also --no-foo-bar; the fields below a ``# --- derived:`` header are not settable (common/cli.py) and give none."""
    path = ROOT / "algorithms" / f"{algo}.py"
    source = path.read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    lines = source.splitlines()
    derived = [i for i in range(cls.lineno, cls.end_lineno + 1) if lines[i - 1].strip().startswith("# --- derived:")]
    flags = {"--help"}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if derived and node.lineno > derived[0]:
            continue
        name = node.target.id.replace("_", "-")
        flags.add(f"--{name}")
        if isinstance(node.annotation, ast.Name) and node.annotation.id == "bool":
            flags.add(f"--no-{name}")
    return frozenset(flags)


def doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ paths and references


def named_paths(path: Path):
    """(line number, path as written) for every repository path the doc names, code blocks included."""
    for n, line in enumerate(doc_text(path).splitlines(), 1):
        for m in PATH.finditer(line):
            yield n, m.group(1)


def test_docs_exist():
    assert (ROOT / "README.md") in DOCS and len([d for d in DOCS if d.parent == ROOT / "docs"]) >= 9
    assert len([d for d in DOCS if "reproduce" in d.parts]) >= 8


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_named_paths_exist(doc):
    missing = [f"{rel(doc)}:{n}: {p}" for n, p in named_paths(doc) if not (ROOT / p).exists()]
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_dotted_references_name_a_top_level_definition(doc):
    bad = []
    for n, line in enumerate(doc_text(doc).splitlines(), 1):
        refs = [(m.group(1), m.group(2)) for m in SLASH_DOTTED.finditer(line) if m.group(2) not in FILE_EXTS]
        refs += [(f"common/{m.group(1)}", m.group(2)) for m in MODULE_DOTTED.finditer(line)]
        for module, name in refs:
            file = ROOT / f"{module}.py"
            if not file.is_file():
                bad.append(f"{rel(doc)}:{n}: {module}{'.' + name if name else ''}: no module {module}.py")
            elif name is not None and name not in top_level_names(file):
                bad.append(f"{rel(doc)}:{n}: {module}.{name}: {module}.py defines no top-level {name}")
    assert not bad, "dotted references in the docs that do not resolve:\n" + "\n".join(bad)


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped (letters, digits, _ and
    - stay), spaces to hyphens, a repeated one suffixed -1, -2, ..."""
    lines = doc_text(path).splitlines()
    seen: dict[str, int] = {}
    for line, in_code in zip(lines, fenced_blocks(lines)):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_relative_links_resolve(doc):
    lines = doc_text(doc).splitlines()
    bad = []
    for n, (line, in_code) in enumerate(zip(lines, fenced_blocks(lines)), 1):
        if in_code:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{rel(doc)}:{n}: {target}: no {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest):
                bad.append(f"{rel(doc)}:{n}: {target}: {rel(dest)} has no heading #{anchor}")
    assert not bad, "links in the docs that do not resolve:\n" + "\n".join(bad)


def normalise_title(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").replace("*", "")
    return " ".join(text.lower().split()).rstrip(".:")


def section_titles(path: Path) -> list[str]:
    """A markdown file's headings and bold paragraph labels (**Scale out.**), normalised."""
    lines = doc_text(path).splitlines()
    titles = []
    for line, in_code in zip(lines, fenced_blocks(lines)):
        if in_code:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        titles += [m.group(1)] if m else re.findall(r"\*\*([^*]+)\*\*", line)
    return [normalise_title(t) for t in titles]


def section_file(name: str, source: Path) -> Path:
    """The file a section reference names: README is the repository's; a bare x.md is docs/x.md or a neighbour."""
    if name in ("README", "README.md"):
        return ROOT / "README.md"
    for candidate in (ROOT / name, ROOT / "docs" / name, source.parent / name):
        if candidate.is_file():
            return candidate
    return ROOT / name


@pytest.mark.parametrize("source", SECTION_SOURCES, ids=rel)
def test_quoted_section_references_exist(source):
    text = doc_text(source)
    if source.suffix != ".md":  # comments: one paragraph of text, whatever the comment markers and line breaks
        text = re.sub(r"\n\s*#+ ?", " ", text)
    bad = []
    for m in SECTION_REF.finditer(re.sub(r"\s+", " ", text)):
        file, title = section_file(m.group(1), source), normalise_title(m.group(2))
        if not file.is_file():
            bad.append(f"{rel(source)}: {m.group(0)}: no file {m.group(1)}")
        elif not any(t.startswith(title) for t in section_titles(file)):
            bad.append(f"{rel(source)}: {m.group(0)}: {rel(file)} has no heading or bold label {m.group(2)!r}")
    assert not bad, "section references that name no section:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------ flags


def attribute_flags(tokens: list[str], current: str | None):
    """Walk a command's tokens: a script path switches to that script (None for a script that is not an algorithm),
    another program or a shell separator switches to None, a comment ends the command. Yields (algo, flag)."""
    for token in tokens:
        if token.startswith("#"):
            return
        if token in SHELL_SEPARATORS or token in OTHER_PROGRAMS:
            current = None
            continue
        m = SCRIPT.search(token.rstrip(",;:)'\""))
        if m:
            current = m.group(1) if m.group(2) == "py" and m.group(1) in ALGOS else None  # not scale/m2po.sh
            continue
        if current is not None:
            for flag in FLAG.findall(token.split("=")[0]):
                yield current, flag


def command_lines(lines: list[str]):
    """(line number, text) of each logical line of the fenced code blocks (backslash continuations joined)."""
    in_code = fenced_blocks(lines)
    n, buf = 0, ""
    for i, (line, code) in enumerate(zip(lines, in_code), 1):
        if not code or line.lstrip().startswith("```"):
            continue
        if not buf:
            n = i
        buf += " " + line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1]
            continue
        yield n, buf
        buf = ""
    if buf:
        yield n, buf


def doc_flags(doc: Path):
    """(line, algo, flag) for the flags the doc gives an algorithm script: in a code block's command line, those after
    `algorithms/<algo>.py` (or `<algo>.py`); in prose, those in backticks, which belong to the script the span names
    (`tba.py --free-running`) or that a possessive right before it names (ppo_stale.py's `--max-staleness`), and
    otherwise to the doc's own script (docs/<algo>.md; none elsewhere)."""
    lines = doc_text(doc).splitlines()
    own = doc.stem if doc.parent == ROOT / "docs" and doc.stem in ALGOS else None
    for n, text in command_lines(lines):
        for algo, flag in attribute_flags(text.split(), None):
            yield n, algo, flag
    for n, (line, code) in enumerate(zip(lines, fenced_blocks(lines)), 1):
        if code:
            continue
        for m in re.finditer(r"`([^`]+)`", line):
            named = re.search(r"\b(\w+)\.py's\s*$", line[: m.start()])  # ppo_stale.py's `--max-staleness`
            for algo, flag in attribute_flags(m.group(1).split(), named.group(1) if named else own):
                yield n, algo, flag


def test_script_flags_are_read_from_args():
    flags = script_flags("grpo")
    assert {"--staleness", "--updates-per-batch", "--total-updates", "--scale-std", "--no-scale-std"} <= flags
    assert {"--cuda", "--no-cuda", "--debug-interrupt-at"} <= flags  # a bool's negation; a hidden field is settable
    assert "--no-staleness" not in flags and "--batch-size" not in flags  # not a bool; derived: not settable
    assert {"--tau", "--m2-variant", "--no-trust-region"} <= script_flags("m2po")


def test_flag_attribution():
    tokens = "torchrun --standalone --nproc-per-node 2 algorithms/grpo.py --micro-batch-size 32".split()
    assert list(attribute_flags(tokens, None)) == [("grpo", "--micro-batch-size")]
    tokens = "python reproduce/eval/evaluate.py --n 32 && python algorithms/m2po.py --tau 0.04 # --x".split()
    assert list(attribute_flags(tokens, None)) == [("m2po", "--tau")]
    assert list(attribute_flags("ppo_stale.py --max-staleness".split(), "grpo")) == [("ppo_stale", "--max-staleness")]
    assert list(attribute_flags("--scale-std/--no-scale-std".split(), "grpo")) == [
        ("grpo", "--scale-std"),
        ("grpo", "--no-scale-std"),
    ]
    assert list(attribute_flags("pip install --no-deps x".split(), "grpo")) == []


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_flags_given_to_a_script_exist(doc):
    bad = sorted(
        {
            f"{rel(doc)}:{n}: {flag} is not a flag of algorithms/{algo}.py"
            for n, algo, flag in doc_flags(doc)
            if flag not in script_flags(algo) and (rel(doc), flag) not in OTHER_TOOL_FLAGS
        }
    )
    hint = "\n(a flag of another script: name it in the backticks, `tba.py --free-running`, or right before them, "
    hint += "tba.py's `--free-running`; another tool's flag with no script named: OTHER_TOOL_FLAGS)"
    assert not bad, "flags in the docs that their script does not have:\n" + "\n".join(bad) + hint
