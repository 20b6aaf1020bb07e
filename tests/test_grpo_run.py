"""grpo.py end to end in subprocesses on a tiny random Llama: invariants of the async loop, resume, failures."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from common.engine import HFEngine
from common.logprobs import collate, pad_float, response_logprobs
from common.models import load_model, load_tokenizer
from common.tasks import encode_prompt, make_task
from conftest import FAST, ROOT, assert_same_run, comparable, metrics_of, run_script
from grpo import aggregate, clipped_surrogate, group_advantages

pytestmark = pytest.mark.run


def test_smoke_run_logs_every_metric(tiny_model_path, tmp_path):
    proc = run_script(
        "grpo.py", "--model", tiny_model_path, *FAST, "--total-updates", "3", "--run-name", "smoke", cwd=tmp_path
    )
    assert "3/3" in proc.stdout and "done: 3 updates" in proc.stdout
    rows = metrics_of(tmp_path, "smoke")
    assert rows[0]["global_step"] == 0 and "eval/accuracy" in rows[0]
    train = [r for r in rows if "losses/policy_loss" in r]
    assert [r["global_step"] for r in train] == [1, 2, 3]
    for key in [
        "charts/reward_mean",
        "charts/accuracy",
        "charts/response_length_mean",
        "charts/truncated_frac",
        "charts/learning_rate",
        "charts/tokens_per_sec",
        "charts/gen_tokens_per_sec",
        "charts/train_tokens_per_sec",
        "losses/policy_loss",
        "losses/kl",
        "losses/entropy",
        "losses/clipfrac",
        "losses/approx_kl",
        "losses/ratio_mean",
        "losses/ratio_max",
        "async/staleness_mean",
        "async/staleness_max",
        "async/policy_version",
        "async/queue_size",
        "async/dropped_samples",
        "async/logprob_diff",
        "async/ess",
        "async/ess_seq",
        "async/log_ratio_m2",
        "async/corrected_frac",
        "async/mismatch_kl",
        "time/rollout",
        "time/train_step",
        "time/weight_sync",
        "time/trainer_wait",
        "time/producer_wait",
    ]:
        assert all(key in r for r in train), key
    assert (tmp_path / "runs" / "smoke" / "model" / "model.safetensors").is_file()
    assert not (tmp_path / "runs" / "smoke" / "checkpoint.pt").exists()  # the training state only when asked


def synchronous_reference(model_path, seed, updates, P=2, G=4, T=6, lr=2e-6, temperature=0.7):
    """A plain synchronous GRPO loop (generate with the current weights, then update), written independently of
    grpo.py's threading, in fp32. Returns the policy losses and mean rewards per update."""
    torch.manual_seed(seed)
    task = make_task("arithmetic", digits=1, eval_size=8, seed=seed)
    tok = load_tokenizer(model_path)
    policy = load_model(model_path)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    engine = HFEngine(policy, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, dtype=torch.float32)
    losses, rewards_out = [], []
    for k in range(updates):
        engine.load_weights(policy.named_parameters(), version=k)
        rows = task.train_rows(k, P)
        unique = [encode_prompt(tok, task.prompt(r)) for r in rows]
        prompts = [p for p in unique for _ in range(G)]
        outs = engine.generate(unique, n=G, max_new_tokens=T, temperature=temperature, seed=seed * 1_000_003 + k)
        texts = tok.batch_decode([o["response"] for o in outs], skip_special_tokens=True)
        rewards = torch.tensor([task.reward(t, rows[i // G]) for i, t in enumerate(texts)])
        adv = group_advantages(rewards.view(-1, G)).view(-1)
        idx = torch.randperm(P * G, generator=torch.Generator().manual_seed(seed * 7919 + k)).tolist()
        batch = collate([prompts[i] for i in idx], [outs[i]["response"] for i in idx], tok.pad_token_id)
        logp, _ = response_logprobs(policy, batch, temperature)
        behav = pad_float([outs[i]["logprobs"] for i in idx], logp.shape[1])
        loss_tok, _, _ = clipped_surrogate(logp, behav, adv[idx], 0.2)
        loss = aggregate(loss_tok, batch["response_mask"], "token-mean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        rewards_out.append(rewards.mean().item())
    return losses, rewards_out


def test_staleness_zero_equals_synchronous_loop(tiny_model_path, tmp_path):
    exact = ["--no-bf16", "--engine-dtype", "float32", "--learning-rate", "1e-3"]
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        *exact,
        "--total-updates",
        "4",
        "--staleness",
        "0",
        "--run-name",
        "s0",
        cwd=tmp_path,
    )
    rows = [r for r in metrics_of(tmp_path, "s0") if "losses/policy_loss" in r]
    losses, rewards = synchronous_reference(tiny_model_path, seed=1, updates=4, lr=1e-3)
    assert any(x != 0 for x in losses)  # advantages were non-zero: the comparison covers real updates
    assert [r["losses/policy_loss"] for r in rows] == pytest.approx(losses, abs=1e-5)
    assert [r["charts/reward_mean"] for r in rows] == pytest.approx(rewards)
    # on-policy, fp32 engine and trainer: ratio is 1 up to rounding and the clip never fires
    assert all(r["losses/clipfrac"] == 0.0 for r in rows)
    assert all(r["async/logprob_diff"] < 1e-4 for r in rows)
    assert all(abs(r["losses/ratio_mean"] - 1) < 1e-4 for r in rows)
    # and the drift diagnostics see no drift: w = 1 up to rounding, nothing corrected
    assert all(r["async/ess"] > 1 - 1e-6 and r["async/ess_seq"] > 1 - 1e-6 for r in rows)
    assert all(r["async/log_ratio_m2"] < 1e-8 and 0 <= r["async/mismatch_kl"] < 1e-8 for r in rows)
    assert all(r["async/corrected_frac"] == 0.0 for r in rows)


@pytest.mark.parametrize("s", [1, 3])
def test_consumed_batches_have_exact_staleness(tiny_model_path, tmp_path, s):
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "7",
        "--staleness",
        str(s),
        "--eval-every",
        "0",
        "--run-name",
        f"s{s}",
        cwd=tmp_path,
    )
    rows = [r for r in metrics_of(tmp_path, f"s{s}") if "losses/policy_loss" in r]
    # update v trains on batch v - 1, generated by version max(0, v - 1 - s): lag min(v - 1, s), so the first s updates
    # train on the initial policy's data (the FIFO warm-up)
    lags = [min(v - 1, s) for v in range(1, 8)]
    assert [r["global_step"] for r in rows] == [r["async/policy_version"] for r in rows] == list(range(1, 8))
    assert [r["async/staleness_max"] for r in rows] == lags
    assert [r["async/staleness_mean"] for r in rows] == lags  # one version per batch: the mean is the lag too
    assert [("async/logprob_diff" in r) for r in rows] == [lag == 0 for lag in lags]  # logged on fresh data only
    assert [("async/mismatch_kl" in r) for r in rows] == [lag == 0 for lag in lags]


def test_staleness_not_multiple_of_updates_per_batch(tiny_model_path, tmp_path):
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "8",
        "--updates-per-batch",
        "2",
        "--staleness",
        "3",
        "--eval-every",
        "0",
        "--run-name",
        "u2s3",
        cwd=tmp_path,
    )
    stal = [r["async/staleness_max"] for r in metrics_of(tmp_path, "u2s3")]
    # batch k is generated by version 2k - 3; its two minibatch updates see lags 3 and 4
    assert stal == [0, 1, 2, 3, 3, 4, 3, 4]


def test_same_seed_same_metrics(tiny_model_path, tmp_path):
    for name in ("a", "b"):
        run_script(
            "grpo.py",
            "--model",
            tiny_model_path,
            *FAST,
            "--total-updates",
            "4",
            "--staleness",
            "2",
            "--run-name",
            name,
            cwd=tmp_path,
        )
    a = comparable(metrics_of(tmp_path, "a"))
    assert_same_run(a, comparable(metrics_of(tmp_path, "b")))
    assert any(r.get("losses/grad_norm", 0) > 0 for r in a)


def test_micro_batching_does_not_change_the_update(tiny_model_path, tmp_path):
    """Gradient accumulation over micro-batches of 3 sequences gives the same training as one pass over 8 (fp32)."""
    exact = ["--no-bf16", "--engine-dtype", "float32", "--learning-rate", "1e-3", "--total-updates", "3"]
    for name, mbs in (("whole", "8"), ("micro", "3")):
        run_script(
            "grpo.py",
            "--model",
            tiny_model_path,
            *FAST,
            *exact,
            "--micro-batch-size",
            mbs,
            "--run-name",
            name,
            cwd=tmp_path,
        )
    whole, micro = (comparable(metrics_of(tmp_path, n)) for n in ("whole", "micro"))
    assert any(r.get("losses/grad_norm", 0) > 0 for r in whole)
    assert [r["global_step"] for r in whole if "losses/policy_loss" in r] == [1, 2, 3]
    assert [r["global_step"] for r in micro] == [r["global_step"] for r in whole]  # the zip below meets every row
    for a, b in zip(whole, micro):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


def test_resume_reproduces_uninterrupted_run(tiny_model_path, tmp_path):
    common = ["--model", tiny_model_path, *FAST, "--staleness", "2", "--updates-per-batch", "2"]
    run_script("grpo.py", *common, "--total-updates", "8", "--run-name", "full", cwd=tmp_path)
    part = run_script(
        "grpo.py",
        *common,
        "--total-updates",
        "8",
        "--debug-interrupt-at",
        "3",
        "--run-name",
        "part",
        cwd=tmp_path,
        check=False,
    )  # interrupted mid-batch
    assert part.returncode == 130, part.stderr[-2000:]
    ck = torch.load(tmp_path / "runs" / "part" / "checkpoint.pt", weights_only=False)
    assert ck["update"] == 3 and len(ck["rollouts"]) >= 1  # the FIFO and the partial batch were saved
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "part"), cwd=tmp_path)
    resumed, full = comparable(metrics_of(tmp_path, "part")), comparable(metrics_of(tmp_path, "full"))
    assert_same_run(resumed, full)
    assert any(r["losses/grad_norm"] > 0 for r in full[1:])  # real updates, not a trivially constant policy


def test_weights_are_kept_only_for_versions_the_run_needs(tiny_model_path, tmp_path):
    """With staleness s the last batches are generated early; the trainer must not pile up weight payloads for
    versions no batch of the run uses (each is a full copy of the weights)."""
    common = ["--model", tiny_model_path, *FAST, "--staleness", "3", "--eval-every", "0"]
    run_script("grpo.py", *common, "--total-updates", "6", "--keep-final-state", "--run-name", "s3", cwd=tmp_path)
    ck = torch.load(tmp_path / "runs" / "s3" / "checkpoint.pt", weights_only=False)
    assert ck["pending_weights"] == []
    # extending that run would need version 3's weights for batch 6: refused with a message
    proc = run_script(
        "grpo.py", "--resume", str(tmp_path / "runs" / "s3"), "--total-updates", "8", cwd=tmp_path, check=False
    )
    assert proc.returncode != 0 and "did not keep" in proc.stderr and "--total-updates" in proc.stderr
    # at s = 0 the only version an extension needs is the checkpoint's own: extending works
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "2",
        "--keep-final-state",
        "--run-name",
        "s0",
        cwd=tmp_path,
    )
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "s0"), "--total-updates", "4", cwd=tmp_path)
    assert [r["global_step"] for r in metrics_of(tmp_path, "s0") if "losses/policy_loss" in r] == [1, 2, 3, 4]


def test_producer_error_ends_the_run(tiny_model_path, tmp_path):
    t0 = time.time()
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "20",
        "--staleness",
        "1",
        "--debug-fail-at-batch",
        "3",
        "--run-name",
        "fail",
        cwd=tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "injected producer failure at batch 3" in proc.stderr and "rollout producer failed" in proc.stderr
    assert time.time() - t0 < 120
    done = [r["global_step"] for r in metrics_of(tmp_path, "fail") if "losses/policy_loss" in r]
    assert max(done) <= 3


def test_ctrl_c_stops_cleanly_and_leaves_a_resumable_checkpoint(tiny_model_path, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "algorithms" / "grpo.py"),
            "--model",
            tiny_model_path,
            *FAST,
            "--total-updates",
            "400",
            "--staleness",
            "2",
            "--eval-every",
            "0",
            "--run-name",
            "intr",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if "] 2/400" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at update" in out
    ck = torch.load(tmp_path / "runs" / "intr" / "checkpoint.pt", weights_only=False)
    n = ck["update"]
    assert 2 <= n < 400
    run_script("grpo.py", "--resume", str(tmp_path / "runs" / "intr"), "--total-updates", str(n + 2), cwd=tmp_path)
    steps = [r["global_step"] for r in metrics_of(tmp_path, "intr") if "losses/policy_loss" in r]
    assert steps == list(range(1, n + 3))


def test_parameters_change_after_an_update(tiny_model_path, tmp_path):
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--total-updates",
        "2",
        "--learning-rate",
        "1e-3",
        "--prompts-per-batch",
        "6",
        "--run-name",
        "p",
        cwd=tmp_path,
    )
    assert any(r.get("losses/grad_norm", 0) > 0 for r in metrics_of(tmp_path, "p"))
    after = load_model(str(tmp_path / "runs" / "p" / "model")).state_dict()  # the trained model the run leaves
    before = load_model(tiny_model_path).state_dict()
    changed = [n for n, t in after.items() if not torch.equal(t, before[n])]
    assert len(changed) > 0.5 * len(before)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--model", "/nonexistent/model"], "no such folder"),
        (["--task", "chess"], "invalid choice 'chess' for argument '--task'"),
        (["--prompts-per-batch", "3", "--group-size", "4", "--updates-per-batch", "5"], "cannot be split"),
        (["--staleness", "-1"], "--staleness must be >= 0"),
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--checkpoint-minutes", "-1"], "--checkpoint-minutes must be >= 0"),
        (["--max-nonfinite-skips", "-1"], "--max-nonfinite-skips must be >= 0"),
        (["--prompts-per-batch", "0"], "--prompts-per-batch must be >= 1, got 0"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--learning-rate", "-1"], "--learning-rate must be > 0"),
        (["--eval-every", "-1"], "--eval-every must be >= 0"),
        (["--eval-size", "0"], "--eval-size 0: --task arithmetic generates its held-out problems"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model_path, tmp_path, flags, message):
    args = ["--model", tiny_model_path, *FAST, *flags] if "--model" not in flags else [*FAST, *flags]
    proc = run_script("grpo.py", *args, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()  # one line, nothing left behind


def test_malformed_dataset_row_is_a_clear_error(tiny_model_path, tmp_path):
    (tmp_path / "gsm").mkdir()
    (tmp_path / "gsm" / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{broken\n")
    (tmp_path / "gsm" / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        "--task",
        "gsm8k",
        "--data-path",
        str(tmp_path / "gsm"),
        cwd=tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0 and "train.jsonl: row 2 is not valid JSON" in proc.stderr
    (tmp_path / "gsm" / "train.jsonl").write_text("\n")  # an empty file: the message names the flag
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        "--task",
        "gsm8k",
        "--data-path",
        str(tmp_path / "gsm"),
        cwd=tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"--data-path {tmp_path / 'gsm' / 'train.jsonl'}: the file has no rows" in proc.stderr


def test_gsm8k_trains_from_a_local_folder(tiny_model_path, tmp_path):
    rows = [
        {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
        for i in range(16)
    ]
    (tmp_path / "gsm").mkdir()
    for split, part in (("train", rows[:12]), ("test", rows[12:])):
        (tmp_path / "gsm" / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in part) + "\n")
    run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--task",
        "gsm8k",
        "--data-path",
        str(tmp_path / "gsm"),
        "--total-updates",
        "2",
        "--run-name",
        "g",
        cwd=tmp_path,
    )
    assert "eval/accuracy" in metrics_of(tmp_path, "g")[-1]


def test_math_task_with_boxed_verifier_from_local_files(tiny_model_path, tmp_path):
    # MATH train + MATH-500 eval, the m2po prompt and its math_verify reward, computed in the producer thread
    fixtures = ROOT / "tests" / "fixtures"
    proc = run_script(
        "grpo.py",
        "--model",
        tiny_model_path,
        *FAST,
        "--task",
        "math",
        "--data-path",
        str(fixtures / "math_train.json"),
        "--eval-data-path",
        str(fixtures / "math500.json"),
        "--total-updates",
        "2",
        "--run-name",
        "m",
        cwd=tmp_path,
    )
    assert "math (eval math500, 4 problems; prompt m2po)" in proc.stdout
    rows = metrics_of(tmp_path, "m")
    assert len(rows) == 3 and all(0.0 <= r["charts/reward_mean"] <= 1.0 for r in rows[1:])
    assert rows[-1]["eval/accuracy"] == 0.0  # a 2-layer random model does not solve MATH
    # ... which says something only if the verifier can say yes: the run's task rewards each problem's own answer,
    # boxed, with 1 and another answer with 0, scored off the main thread as the producer thread does
    task = make_task(
        "math", data_path=str(fixtures / "math_train.json"), eval_data_path=str(fixtures / "math500.json"), eval_size=8
    )
    problems = task.eval_rows + task.train_rows(0, 4)
    scores = []
    worker = threading.Thread(
        target=lambda: scores.extend(
            (
                task.reward(f"So the answer is $\\boxed{{{row['answer']}}}$.", row),
                task.reward("So the answer is $\\boxed{-12345}$.", row),
            )
            for row in problems
        )
    )
    worker.start()
    worker.join(timeout=120)
    assert len(problems) == 8 and scores == [(1.0, 0.0)] * 8, scores
