"""Same seed, same machine, same flags: the same metrics, bit for bit, at any staleness.

Two runs of each script start together (so the two processes load both cores, and each run's producer thread
generates while its trainer trains) and must log identical rows: every value except timings and the queue size,
compared with ==. The bf16 trainer once differed in the last bits at s > 0 because a thread beside it cleared torch's
process-wide autocast cache (common.logprobs.side_autocast). That was a race: on the tiny model a step is so short that
it rarely struck (on the chain toy policy, at the first updates), so tests/test_common.py checks the cache itself, in
every run, and these runs check the whole of each script, the tba lockstep searcher included.
"""

import os
import subprocess
import sys

import pytest

from conftest import FAST, ROOT, comparable, metrics_of

pytestmark = pytest.mark.run

SCRIPTS = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py"))
# per script: a lag at which the producer runs ahead of the trainer (tba: its sync period, the lockstep searcher)
LAGGED = {script: ["--staleness", "3", "--updates-per-batch", "1"] for script in SCRIPTS}
LAGGED["tba"] = ["--staleness", "2", "--temperature", "1.0"]  # some rewards: the tiny model answers at random
LAGGED["dapo"] += ["--max-sampling-rounds", "50"]  # the tiny model rarely has a reward spread
LAGGED["vineppo"] = ["--staleness", "3", "--mc-samples", "2"]
# per script: the logged fraction(s) whose sum is the share of tokens its correction removed (async/corrected_frac)
CORRECTED = {script: ["losses/clipfrac"] for script in SCRIPTS}
CORRECTED["ppo_stale"] = ["losses/clipfrac", "losses/behav_capped_frac"]  # the clip, and the behaviour-weight cap
CORRECTED["tba"] = []  # trajectory balance has no importance-ratio correction


def run_together(script: str, flags: list[str], names: tuple[str, ...], cwd) -> None:
    """Start one run of algorithms/<script> per name at once (one intra-op thread each) and wait for all."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "algorithms" / f"{script}.py"), *flags, "--run-name", name],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in names
    ]
    for name, proc in zip(names, procs):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{script} {name} exited {proc.returncode}\n{out[-3000:]}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_same_seed_runs_started_together_are_bit_identical_at_a_lag(tiny_model_path, tmp_path, script):
    flags = ["--model", tiny_model_path, *FAST, *LAGGED[script], "--total-updates", "8"]
    run_together(script, flags, ("a", "b"), tmp_path)
    a, b = (comparable(metrics_of(tmp_path, name)) for name in ("a", "b"))
    assert len(a) == len(b) == 9  # the update-0 evaluation and 8 updates
    assert any(r.get("async/staleness_max", 0) > 0 for r in a)  # the lag is reached
    assert any(r.get("losses/grad_norm", 0) > 0 for r in a)  # real gradients, so the bits have something to differ in
    for ra, rb in zip(a, b):
        assert ra == rb, (script, ra["global_step"], {k: (v, rb.get(k)) for k, v in ra.items() if rb.get(k) != v})
    assert_drift_diagnostics(script, a)


def assert_drift_diagnostics(script: str, rows: list[dict]) -> None:
    """The async/ drift diagnostics (common/drift.py) in every training row, consistent with the script's own
    metrics: mismatch_kl exactly where logprob_diff is (tokens sampled by the trained weights), corrected_frac the
    share its correction removed, and for m2po log_ratio_m2 its M2."""
    train = [r for r in rows if "losses/grad_norm" in r]
    assert any("async/mismatch_kl" in r for r in train) and any("async/mismatch_kl" not in r for r in train)
    for r in train:
        assert 0 < r["async/ess"] <= 1 + 1e-12 and 0 < r["async/ess_seq"] <= 1 + 1e-12
        assert r["async/log_ratio_m2"] >= 0
        assert ("async/mismatch_kl" in r) == ("async/logprob_diff" in r)
        assert r["async/corrected_frac"] == pytest.approx(sum(r[k] for k in CORRECTED[script]), abs=1e-6)
        if script == "m2po":
            assert r["async/log_ratio_m2"] == pytest.approx(r["m2po/M2"], rel=1e-5)


def test_a_deep_fifo_is_bit_identical_too(tiny_model_path, tmp_path):
    """grpo.py with a FIFO of 16 rollout batches (s = 64, 4 updates per batch, the figures' layout at a quarter of
    their depth): the producer fills the whole warm-up ahead while the trainer trains."""
    lag = ["--staleness", "64", "--updates-per-batch", "4", "--prompts-per-batch", "4", "--total-updates", "72"]
    flags = ["--model", tiny_model_path, *FAST, *lag, "--eval-every", "0"]
    run_together("grpo", flags, ("a", "b"), tmp_path)
    a, b = (comparable(metrics_of(tmp_path, name)) for name in ("a", "b"))
    assert len(a) == 72 and max(r["async/staleness_max"] for r in a) >= 64
    assert a == b
