"""The blocks marked as shared plumbing read the same in all seven scripts (so that ``diff grpo.py m2po.py`` shows the
algorithm), except for the differences listed in ALLOWED, each with its reason (docs/README.md)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ALGORITHMS = Path(__file__).resolve().parents[1] / "algorithms"
SCRIPTS = ("grpo", "dapo", "m2po", "dppo", "ppo_stale", "tba", "vineppo")
# a banner in __main__: "# ----...---- shared plumbing: <name>" or "# ---- algorithm: <what>"
BANNER = re.compile(r"^\s*# -{4,} (shared plumbing|algorithm)(?::\s*(.*?))?\s*$")
# an Args group header: "# --- <title>"
GROUP = re.compile(r"^\s*# --- (.+?)\s*$")
# script -> {shared block or Args group: why it differs from grpo.py's}
ALLOWED = {
    "dapo": {
        "checks and setup": "its flag checks; dynamic sampling's place in the prompt stream (kept across resumes)",
        "rollout producer (thread)": "dynamic sampling: rounds of prompts until enough groups have a reward spread",
        "training loop (algorithm marked)": "checkpoints keep dynamic sampling's place in the prompt stream",
        "logging and checkpoints": "dapo/* metrics; accuracy, lengths and tokens over all sampling rounds",
    },
    "m2po": {
        "checks and setup": "--tau > 0, and --updates-per-batch 4 by default when stale (M2PO's recipe)",
        "logging and checkpoints": "m2po/* metrics (M2 before and after the trust region), their console columns",
    },
    "dppo": {
        "logging and checkpoints": "dppo/* metrics (the masked fraction by direction, the divergence)",
    },
    "ppo_stale": {
        "checks and setup": "bounded staleness (--max-staleness): its checks, weights for every version, resume",
        "rollout producer (thread)": "AReaL's admission control; weights land between decoding steps",
        "logging and checkpoints": "per-token staleness, the proximal pass and the decoupled loss's metrics",
    },
    "tba": {
        "checks and setup": "the sync period, whole prompt slots per micro-batch, pi_ref on rank 0, the replay buffer",
        "rollout producer (thread)": "the searcher fills the replay buffer, round n by the version its number fixes",
        "training loop (algorithm marked)": "draws from the replay buffer; checkpoints hold the buffer and sampler",
        "weight sync to the engine (only versions a future batch is generated with)": "a payload every k updates",
        "logging and checkpoints": "tba/* metrics and the ages of replayed samples",
        "derived: filled in at start": "sync_every; no minibatches (a batch is one update)",
    },
    "vineppo": {
        "checks and setup": "epochs (U = updates_per_batch * epochs), its checks, the value estimator in the header",
        "rollout producer (thread)": "Monte Carlo value rollouts with the behaviour policy's weights",
        "training loop (algorithm marked)": "checkpoints keep the critic, its optimizer and the ratio guard's count",
        "logging and checkpoints": "vineppo/* metrics and losses/value_loss, their console columns",
    },
}


def shared_blocks(script: str) -> dict[str, str]:
    """The script's shared-plumbing blocks by name: each runs from its banner to the next banner of either kind."""
    lines = (ALGORITHMS / f"{script}.py").read_text().splitlines()
    main = lines.index('if __name__ == "__main__":')
    blocks, name = {}, None
    for line in lines[main:]:
        m = BANNER.match(line)
        if m:
            name = m.group(2) if m.group(1) == "shared plumbing" else None
            if name is not None:
                assert name not in blocks, f"{script}.py: two shared blocks named {name!r}"
                blocks[name] = ""
        elif name is not None:
            blocks[name] += line + "\n"
    return blocks


def args_groups(script: str) -> dict[str, str]:
    """The Args class's groups by title (the fields under each ``# --- <title>`` header)."""
    source = (ALGORITHMS / f"{script}.py").read_text()
    body = source[source.index("class Args:") : source.index("\n\n\n", source.index("class Args:"))]
    groups, title = {}, None
    for line in body.splitlines()[1:]:
        m = GROUP.match(line)
        if m:
            title = m.group(1)
            groups[title] = ""
        elif title is not None:
            groups[title] += line + "\n"
    return groups


def test_every_script_has_the_same_shared_blocks_in_the_same_order():
    reference = list(shared_blocks("grpo"))
    assert reference[:3] == ["checks and setup", "rollout producer (thread)", "evaluation"]
    assert reference[-1] == "teardown"
    for script in SCRIPTS[1:]:
        assert list(shared_blocks(script)) == reference, script


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_shared_blocks_are_identical_to_grpos(script):
    reference, blocks = shared_blocks("grpo"), shared_blocks(script)
    for name, text in blocks.items():
        if name in ALLOWED.get(script, {}):
            assert text != reference[name], f"{script}.py {name!r} is listed in ALLOWED but no longer differs"
        else:
            assert text == reference[name], f"{script}.py: shared block {name!r} differs from grpo.py's"


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_shared_args_groups_are_identical_to_grpos(script):
    """Every Args group but the algorithm's own block (its settings and the defaults of its recipe)."""
    reference, groups = args_groups("grpo"), args_groups(script)
    shared = [t for t in reference if not t.startswith("GRPO")]
    assert [t for t in groups if t in shared] == shared, script
    for title in shared:
        if title in ALLOWED.get(script, {}):
            assert groups[title] != reference[title], f"{script}.py {title!r} is listed in ALLOWED but is identical"
        else:
            assert groups[title] == reference[title], f"{script}.py: Args group {title!r} differs from grpo.py's"


def test_every_allowed_difference_names_a_block_or_group_that_exists():
    for script, reasons in ALLOWED.items():
        names = {*shared_blocks(script), *args_groups(script)}
        assert set(reasons) <= names, (script, set(reasons) - names)
