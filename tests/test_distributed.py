"""Multi-rank training (common/distributed.py, torchrun) on CPUs with gloo: the helpers on one and two ranks, and
every script run as one process and as 2 trainer ranks, which must give the same run.

Tolerance of the 1-process vs 2-rank comparison: rel 1e-4 / abs 1e-5 on every logged number except timings (fp32
trainer and engine). Two ranks sum their micro-batches' gradients in another order than one process does, so the
runs agree to float rounding (observed: <= 8e-6 absolute), not bit for bit; a wrong normalisation, a lost or
doubled micro-batch, or a stale weight sync changes them by orders of magnitude more.
"""

import json
import os

import pytest
import torch

from common.distributed import (
    all_ranks,
    barrier,
    broadcast,
    full_state_dicts,
    init_distributed,
    is_sharded,
    load_full_state_dicts,
    merge_ranks,
    shard_model,
    shutdown,
)
from common.models import load_model
from common.tracking import read_metrics
from common.vllm_engine import engine_gpus
from conftest import ROOT, assert_same_run_across_ranks, run_script, run_torchrun

PRECISE = ["--no-bf16", "--engine-dtype", "float32"]
G = ["--digits", "1", "--max-new-tokens", "6", "--eval-size", "8", "--eval-every", "2", "--total-updates", "6"]
RUNS = {  # per script: flags whose 2-rank run exercises the algorithm's own path (staleness, clipping, masking ...)
    "grpo": [
        "grpo.py",
        *G,
        "--prompts-per-batch",
        "4",
        "--group-size",
        "4",
        "--micro-batch-size",
        "4",
        "--staleness",
        "2",
        "--learning-rate",
        "1e-2",
        "--kl-coef",
        "0.05",
        "--temperature",
        "1.0",
    ],
    "m2po": [
        "m2po.py",
        *G,
        "--prompts-per-batch",
        "4",
        "--group-size",
        "8",
        "--micro-batch-size",
        "8",
        "--staleness",
        "2",
        "--updates-per-batch",
        "1",
        "--learning-rate",
        "1e-2",
        "--tau",
        "0.001",
    ],
    "dppo": [
        "dppo.py",
        *G,
        "--seed",  # rollouts with a reward spread: the mask drops tokens both ways (A > 0 and A < 0)
        "3",
        "--prompts-per-batch",
        "4",
        "--group-size",
        "4",
        "--micro-batch-size",
        "4",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--learning-rate",
        "1e-2",
        "--delta-tv",
        "0.02",
        "--temperature",
        "1.0",
    ],
    "dapo": [
        "dapo.py",
        "--digits",
        "1",
        "--prompts-per-batch",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "3",
        "--overlong-buffer",
        "1",
        "--eval-size",
        "8",
        "--eval-every",
        "2",
        "--max-sampling-rounds",
        "50",
        "--total-updates",
        "6",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--micro-batch-size",
        "1",
        "--overlong-filtering",
        "--kl-coef",
        "0.05",
        "--learning-rate",
        "3e-3",
        "--temperature",
        "1.0",
    ],
    "ppo_stale": [
        "ppo_stale.py",
        *G,
        "--prompts-per-batch",
        "4",
        "--group-size",
        "4",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--micro-batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--clip-eps",
        "0.05",
        "--behav-weight-cap",
        "1.1",
        "--kl-coef",
        "0.1",
        "--temperature",
        "1.0",
    ],
    "tba": [
        "tba.py",
        *G,
        "--prompts-per-batch",
        "8",
        "--group-size",
        "4",
        "--learning-rate",
        "1e-3",
        "--beta-start",
        "1.0",
        "--beta-end",
        "0.5",
        "--staleness",
        "0",
        "--micro-batch-size",
        "8",
    ],
    "vineppo": [
        "vineppo.py",
        *G,
        "--prompts-per-batch",
        "4",
        "--group-size",
        "4",
        "--mc-samples",
        "3",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--epochs",
        "2",
        "--micro-batch-size",
        "2",
        "--learning-rate",
        "1e-2",
        "--kl-coef",
        "0.1",
        "--ratio-guard",
        "1.03",
    ],
    "vineppo_critic": [
        "vineppo.py",
        *G,
        "--prompts-per-batch",
        "4",
        "--group-size",
        "4",
        "--seed",
        "4",
        "--value-estimator",
        "critic",
        "--critic-head-learning-rate",
        "1e-2",
        "--staleness",
        "2",
        "--updates-per-batch",
        "2",
        "--epochs",
        "2",
        "--micro-batch-size",
        "5",
        "--learning-rate",
        "1e-2",
        "--kl-coef",
        "0.1",
        "--ratio-guard",
        "1.03",
    ],
}


def runs_of(cwd, name):
    return read_metrics(cwd / "runs" / name / "metrics.jsonl")


# ---------------------------------------------------------------- the helpers in one process (world of 1)


@pytest.mark.unit
def test_one_process_is_rank_0_of_1_and_a_bad_timeout_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(cuda=False, timeout_minutes=5) == (0, 1, torch.device("cpu"))
    with pytest.raises(SystemExit, match="--dist-timeout-minutes must be > 0, got 0"):
        init_distributed(cuda=False, timeout_minutes=0)


def test_one_process_helpers_pass_through(tiny_model_path):
    assert init_distributed(cuda=False) == (0, 1, torch.device("cpu"))
    model = load_model(tiny_model_path)
    assert shard_model(model, torch.device("cpu")) is model and not is_sharded(model)
    assert broadcast({"a": 1}) == {"a": 1} and all_ranks(3) == [3]
    tok, total, items = merge_ranks({"x": [torch.ones(2), torch.zeros(1)]}, 2.5, [1, 2])
    assert tok["x"].tolist() == [1, 1, 0] and total == 2.5 and items == [1, 2]
    assert merge_ranks(4) == 4
    barrier()
    shutdown()


def test_full_state_dicts_round_trip_in_one_process(tiny_model_path):
    model = load_model(tiny_model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    assert model_state.keys() == model.state_dict().keys()
    other = load_model(tiny_model_path)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    load_full_state_dicts(other, other_opt, model_state, optimizer_state)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n
    for a, b in zip(optimizer.state_dict()["state"].values(), other_opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_state_dicts_before_the_first_step_leave_adamw_unstepped(tiny_model_path):
    """A checkpoint before AdamW's first step (update 0) holds no optimizer state, saving it leaves the running
    optimizer as it was, and a run resumed from it takes the step an uninterrupted run takes (torch's state-dict API
    would count a zero step as AdamW's first, which changes the bias correction of every later step)."""

    def first_step(model, optimizer):
        model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
        optimizer.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model = load_model(tiny_model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    assert optimizer_state["state"] == {} and not optimizer.state  # saved and left unstepped
    resumed = load_model(tiny_model_path)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    load_full_state_dicts(resumed, resumed_opt, model_state, optimizer_state)
    assert not resumed_opt.state
    expected, got = first_step(model, optimizer), first_step(resumed, resumed_opt)
    for n, w in expected.items():
        assert torch.equal(w, got[n]), n
    assert all(s["step"] == 1 for s in resumed_opt.state.values())


def test_engine_gpus_are_the_nodes_gpus_after_the_trainers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    assert engine_gpus(2) == ["6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert engine_gpus(2) == ["5", "7"]
    with pytest.raises(SystemExit, match="start fewer trainer processes"):
        engine_gpus(3)


# ---------------------------------------------------------------- the helpers on two ranks
@pytest.mark.torchrun
def test_helpers_on_two_ranks(tiny_model_path, tmp_path):
    """Sharded gradients = one-process gradients of the whole batch; state dicts round-trip (and load into a plain
    model); the weight payload is gathered on rank 0 and an engine loaded with it matches the sharded trainer;
    gathered params let ranks generate alone."""
    proc = run_torchrun(str(ROOT / "tests" / "distributed_checks.py"), tiny_model_path, cwd=tmp_path)
    assert proc.stdout.count("all distributed checks passed") == 2, proc.stdout[-2000:]


# ---------------------------------------------------------------- every script: one process vs two ranks
@pytest.mark.run
@pytest.mark.torchrun
@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_give_the_one_process_run(name, tiny_model_path, tmp_path):
    script, *flags = RUNS[name]
    flags = ["--model", tiny_model_path, *PRECISE, *flags]
    run_script(script, *flags, "--run-name", "one", cwd=tmp_path)
    proc = run_torchrun(script, *flags, "--run-name", "two", cwd=tmp_path)
    assert "2 trainer rank(s) on cpu" in proc.stdout and "done: 6 updates" in proc.stdout
    assert proc.stdout.count("done: 6 updates") == 1  # rank 0 alone prints and logs
    one, two = runs_of(tmp_path, "one"), runs_of(tmp_path, "two")
    assert_same_run_across_ranks(one, two)
    diffs = [r["async/logprob_diff"] for r in two if "async/logprob_diff" in r]
    assert diffs and max(diffs) < 1e-4, diffs  # the weight sync from 2 ranks reaches the engine
    assert sorted(os.listdir(tmp_path / "runs")) == ["one", "two"]
    for run in ("one", "two"):  # the trained policy as an HF folder, no training state left behind
        folder = tmp_path / "runs" / run
        assert (folder / "model" / "model.safetensors").is_file() and not (folder / "checkpoint.pt").exists()
        assert json.loads((folder / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    a, b = load_model(str(tmp_path / "runs" / "one" / "model")), load_model(str(tmp_path / "runs" / "two" / "model"))
    initial = load_model(tiny_model_path).state_dict()
    moved = max((w - initial[k]).abs().max().item() for k, w in a.state_dict().items())
    apart = max((w - b.state_dict()[k]).abs().max().item() for k, w in a.state_dict().items())
    assert apart <= 1e-2 * moved, (apart, moved)  # the two-rank export holds the one-process weights (fp32 sums)


@pytest.mark.run
@pytest.mark.torchrun
def test_two_rank_checkpoints_resume_on_one_rank_and_back(tiny_model_path, tmp_path):
    script, *flags = RUNS["grpo"]
    flags = ["--model", tiny_model_path, *PRECISE, *flags]
    run_script(script, *flags, "--run-name", "whole", cwd=tmp_path)
    proc = run_torchrun(
        script, *flags, "--run-name", "two_then_one", "--debug-interrupt-at", "3", cwd=tmp_path, check=False
    )
    assert "interrupted at update 3" in proc.stdout and proc.returncode != 0
    run_script(script, "--resume", str(tmp_path / "runs" / "two_then_one"), cwd=tmp_path)
    proc = run_script(
        script, *flags, "--run-name", "one_then_two", "--debug-interrupt-at", "3", cwd=tmp_path, check=False
    )
    assert proc.returncode == 130
    run_torchrun(script, "--resume", str(tmp_path / "runs" / "one_then_two"), cwd=tmp_path)
    whole = runs_of(tmp_path, "whole")
    assert_same_run_across_ranks(whole, runs_of(tmp_path, "two_then_one"))
    assert_same_run_across_ranks(whole, runs_of(tmp_path, "one_then_two"))


@pytest.mark.torchrun
def test_micro_batches_that_cannot_be_dealt_to_the_ranks_are_refused(tiny_model_path, tmp_path):
    proc = run_torchrun(
        "grpo.py",
        "--model",
        tiny_model_path,
        "--prompts-per-batch",
        "2",
        "--group-size",
        "4",
        "--micro-batch-size",
        "3",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "makes 3 micro-batches of --micro-batch-size 3, which cannot be dealt evenly to 2 trainer ranks" in proc.stderr
    )


@pytest.mark.run
def test_vllm_gpus_without_gpus_is_refused(tiny_model_path, tmp_path):
    proc = run_script(
        "grpo.py", "--model", tiny_model_path, "--vllm-gpus", "1", "--total-updates", "1", cwd=tmp_path, check=False
    )
    assert proc.returncode != 0 and "--vllm-gpus needs --engine vllm" in proc.stderr


SCALE = ROOT / "reproduce" / "scale"
PAPER_SETTINGS = {  # per paper (reproduce/scale/<paper>.sh): its script and the settings that make it that paper's run
    "m2po": (
        "m2po",
        dict(
            model="Qwen/Qwen2.5-Math-7B",
            task="deepscaler",
            staleness=256,
            updates_per_batch=4,
            group_size=8,
            tau=0.04,
            learning_rate=1e-6,
            temperature=1.0,
            kl_coef=0.0,
        ),
    ),
    "dppo": (
        "dppo",
        dict(
            model="Qwen/Qwen3-30B-A3B-Base",
            task="dapo17k",
            eval_task="aime24",
            prompt_template="dapo",
            group_size=16,
            updates_per_batch=8,
            staleness=0,
            max_new_tokens=8192,
            divergence="tv",
            delta_tv=0.15,
            delta_kl=0.05,
            ratio_cap=None,
            scale_std=False,
            loss_agg="seq-mean-token-sum-norm",
            kl_coef=0.0,
            learning_rate=1e-6,
            temperature=1.0,
        ),
    ),
    "grpo": (
        "grpo",
        dict(
            model="deepseek-ai/deepseek-math-7b-instruct",
            group_size=64,
            max_new_tokens=1024,
            kl_coef=0.04,
            loss_agg="seq-mean-token-mean",
            updates_per_batch=1,
            staleness=0,
            learning_rate=1e-6,
        ),
    ),
    "dapo": (
        "dapo",
        dict(
            model="Qwen/Qwen2.5-32B",
            task="dapo17k",
            group_size=16,
            updates_per_batch=16,
            max_new_tokens=20480,
            overlong_buffer=4096,
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            clip_higher=True,
            dynamic_sampling=True,
            oversample=3,
            token_level_loss=True,
            overlong_shaping=True,
            overlong_filtering=False,
            kl_coef=0.0,
            learning_rate=1e-6,
        ),
    ),
    "areal": (
        "ppo_stale",
        dict(
            model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            task="deepscaler",
            max_staleness=4,
            staleness=0,
            decoupled=True,
            behav_weight_cap=5.0,
            clip_eps=0.2,
            adv_norm="batch",
            group_size=16,
            updates_per_batch=4,
            learning_rate=2e-5,
            max_new_tokens=27648,
        ),
    ),
    "tba": (
        "tba",
        dict(
            model="realtreetune/rho-1b-sft-GSM8K",
            task="gsm8k",
            prompt_template="tba",
            group_size=20,
            staleness=2,
            recency_prob=0.95,
            beta_start=0.014,
            beta_end=0.004,
            learning_rate=1e-5,
            temperature=0.7,
            max_new_tokens=512,
            free_running=True,
            rounds_ahead=-1,
        ),
    ),
    "vineppo": (
        "vineppo",
        dict(
            model="realtreetune/deepseekmath-7b-sft-GSM8K",
            task="gsm8k",
            prompt_template="vineppo",
            group_size=8,
            mc_samples=9,
            max_steps=25,
            epochs=2,
            updates_per_batch=8,
            kl_coef=1e-4,
            clip_eps=0.2,
            temperature=0.6,
            learning_rate=1e-6,
            value_estimator="mc",
        ),
    ),
}
SMALLER = {
    "m2po": "Qwen/Qwen2.5-Math-1.5B",
    "dppo": "Qwen/Qwen3-1.7B-Base",
    "grpo": "Qwen/Qwen2.5-1.5B-Instruct",
    "dapo": "Qwen/Qwen2.5-1.5B",
    "areal": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "vineppo": "realtreetune/rho-1b-sft-GSM8K",
}


def dry_run(*argv, node_rank="0") -> list[str]:
    """The command a reproduce/scale launch prints with DRY_RUN=1, split into arguments."""
    import shlex
    import subprocess

    env = dict(os.environ, DRY_RUN="1", NODE_RANK=node_rank, MASTER_ADDR="10.0.0.1")
    return shlex.split(
        subprocess.run(["bash", *map(str, argv)], env=env, check=True, capture_output=True, text=True).stdout
    )


@pytest.mark.run  # the launch files' DRY_RUN, in bash
@pytest.mark.parametrize("paper", list(PAPER_SETTINGS))
@pytest.mark.parametrize("mode,world", [("colocated", 1), ("node", 6), ("nodes", 14)])
def test_launch_script_flags_parse_and_split_over_its_ranks(paper, mode, world):
    """reproduce/scale/launch.sh <paper> <mode> (DRY_RUN: prints its command): every flag exists in the paper's
    script's Args, the micro-batches of an update can be dealt to the launch's trainer ranks (6 on one node, 6 + 8
    on two; the scripts refuse to start otherwise), the engine is vLLM, and the paper's key settings are set."""
    import importlib

    import tyro

    from common.tasks import BENCHMARKS, TEMPLATES, TRAIN_SETS

    argv = dry_run(SCALE / "launch.sh", paper, mode)
    assert argv == dry_run(SCALE / f"{paper}.sh", mode)  # the paper's file runs the same launch on its own
    at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    script, expected = PAPER_SETTINGS[paper]
    assert argv[at] == f"algorithms/{script}.py"
    args = tyro.cli(importlib.import_module(script).Args, args=argv[at + 1 :])
    if script == "tba":  # whole prompt slots per micro-batch (tba.py's check)
        assert args.micro_batch_size >= args.group_size and args.buffer_capacity >= args.group_size
        n_micro = -(-args.prompts_per_batch // (args.micro_batch_size // args.group_size))
    else:  # grpo.py's check, the same in every other script
        batch = args.prompts_per_batch * args.group_size
        assert batch % args.updates_per_batch == 0
        n_micro = -(-(batch // args.updates_per_batch) // args.micro_batch_size)
    assert n_micro % world == 0, (paper, mode, n_micro, world)
    assert args.engine == "vllm" and (args.vllm_gpus > 0) == (mode != "colocated")
    assert args.task in TRAIN_SETS and args.eval_task in BENCHMARKS and args.prompt_template in TEMPLATES
    if TEMPLATES[args.prompt_template][2] in ("last_number", "hash"):  # number-only verifiers: GSM8K's answers only
        assert args.task == args.eval_task == "gsm8k"
    if mode == "colocated" and paper in SMALLER:  # the paper's model does not fit one GPU with its trainer state
        expected = dict(expected, model=SMALLER[paper])
    for name, value in expected.items():
        assert getattr(args, name) == value, (paper, mode, name, getattr(args, name), value)
    if paper == "dapo":
        assert 0 < args.overlong_buffer < args.max_new_tokens
    if mode == "nodes":  # node 1 runs the 8 other trainer ranks
        one = dry_run(SCALE / "launch.sh", paper, mode, node_rank="1")
        assert one[one.index("--nproc-per-node") + 1] == "8" and argv[argv.index("--nproc-per-node") + 1] == "6"


@pytest.mark.run
def test_launch_script_without_a_paper_runs_m2po():
    """The original usage, reproduce/scale/launch.sh <mode>, still launches M2PO's settings."""
    assert dry_run(SCALE / "launch.sh", "node") == dry_run(SCALE / "launch.sh", "m2po", "node")
