"""reproduce/toy/make_toy_policy.py: the character tokenizer and its chat template, a tiny build, and grpo.py on it."""

import importlib.util
import json

import pytest

from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task
from common.tracking import read_metrics
from conftest import ROOT, run_script
from conftest import TOY_SCRIPT as SCRIPT
from conftest import TOY_TINY as TINY


def load_toy():
    spec = importlib.util.spec_from_file_location("make_toy_policy", ROOT / "reproduce" / "toy" / "make_toy_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tokenizer_round_trips_prompts_answers_and_chat(tmp_path):
    tok = load_toy().build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    for t in (tok, loaded):
        assert t.unk_token_id not in t(load_toy().CHARACTERS, add_special_tokens=False)["input_ids"]
        assert {t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id} == {0, 1, 2, 3}
    task = make_task("arithmetic", digits=3, eval_size=20)
    rows = task.eval_rows + task.train_rows(0, 20)
    for row in rows:
        text = task.prompt(row)
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and loaded.unk_token_id not in ids  # one token per character
        assert loaded.decode(ids) == text
        chat = encode_prompt(loaded, text)
        assert chat == encode_prompt(tok, text)
        assert loaded.decode(chat) == f"<s><|user|>{text}<|assistant|>"
        assert loaded.decode(chat, skip_special_tokens=True) == text
        answer = loaded(row["answer"], add_special_tokens=False)["input_ids"] + [loaded.eos_token_id]
        assert loaded.batch_decode([answer], skip_special_tokens=True) == [row["answer"]]
        assert task.reward(loaded.batch_decode([answer], skip_special_tokens=True)[0], row) == 1.0
    convo = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    assert loaded.apply_chat_template(convo, tokenize=False) == "<s><|user|>What is 1 + 2?<|assistant|>3</s>"
    assert loaded.padding_side == "left"


def test_build_config_and_bad_shapes():
    toy = load_toy()
    cfg = toy.build_config(toy.build_tokenizer())
    assert cfg.head_dim == 32 and cfg.tie_word_embeddings and cfg.vocab_size == len(toy.build_tokenizer())
    with pytest.raises(SystemExit, match="divisible"):
        toy.build_config(toy.build_tokenizer(), hidden_size=100, num_heads=3)


@pytest.mark.run
def test_tiny_build_loads_and_records_its_warm_start(toy_path):
    path = resolve_model(str(toy_path))
    tok, model = load_tokenizer(path), load_model(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 1
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    manifest = json.loads((toy_path / "toy_policy.json").read_text())
    assert manifest["steps"] == 3 and manifest["digits"] == 1 and manifest["eval_size"] == 8
    assert manifest["band"] == manifest["sampled_band"] == [0.0, 1.0]
    assert manifest["checks"] == [
        {"step": 3, "greedy": manifest["eval_accuracy"], "sampled": manifest["sampled_accuracy"]}
    ]
    assert 0.0 <= manifest["eval_accuracy"] <= 1.0 and manifest["warm_start_seconds"] >= 0


@pytest.mark.run
def test_tiny_chain_build_records_what_rl_will_meet(tmp_path):
    run_script(
        SCRIPT,
        "--task",
        "chain",
        "--out",
        str(tmp_path / "chain"),
        *TINY,
        "--eval-max-new-tokens",
        "24",
        "--stats-prompts",
        "4",
        "--stats-samples",
        "2",
        cwd=tmp_path,
        timeout=300,
    )
    manifest = json.loads((tmp_path / "chain" / "toy_policy.json").read_text())
    assert manifest["task"] == "chain" and manifest["digits"] == 1 and manifest["steps"] == 3
    chain = load_toy().TASK_DEFAULTS["chain"]
    for key in ("learning_rate", "micro_batches", "replay_every", "max_position_embeddings"):  # unset: chain's own
        assert manifest["args"][key] == chain[key], key
    rollouts = manifest["rollouts"]
    assert rollouts["samples"] == 8 and rollouts["max_new_tokens"] == 24 and 0 <= rollouts["truncated_frac"] <= 1
    assert 1 <= rollouts["tokens_median"] <= rollouts["tokens_p95"] <= 24 and rollouts["steps_mean"] >= 0
    assert manifest["update_seconds"]["seconds_per_update"] > 0
    errors = manifest["greedy_errors"]
    assert errors["of"] == 8 and sum(errors["first_wrong_step"].values()) == errors["wrong"]
    assert load_model(resolve_model(str(tmp_path / "chain"))).config.max_position_embeddings == 256


@pytest.mark.run
def test_grpo_runs_on_the_toy_policy(toy_path, tmp_path):
    run_script(
        "grpo.py",
        "--model",
        str(toy_path),
        "--digits",
        "1",
        "--prompts-per-batch",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--eval-size",
        "8",
        "--total-updates",
        "2",
        "--eval-every",
        "2",
        "--run-name",
        "toy",
        cwd=tmp_path,
    )
    rows = read_metrics(tmp_path / "runs" / "toy" / "metrics.jsonl")
    assert [r["global_step"] for r in rows if "losses/policy_loss" in r] == [1, 2]
    assert "eval/accuracy" in rows[-1]


def test_error_histogram_counts_first_wrong_steps_and_per_step_rates():
    from types import SimpleNamespace

    rows = [{"solution": f"1 + 1 = 2\n2 + 1 = 3\n#### {a}", "answer": str(a)} for a in (3, 3, 3, 3, 3)]
    task = SimpleNamespace(
        eval_rows=rows, reward=lambda text, row: float(text.strip().endswith(f"#### {row['answer']}"))
    )
    texts = [
        rows[0]["solution"],  # right
        "1 + 1 = 3\n3 + 1 = 4\n#### 4",  # wrong at step 1
        "1 + 1 = 2\n2 + 1 = 4\n#### 4",  # wrong at step 2
        "1 + 1 = 2\n2 + 1 = 4\n#### 4",
        "1 + 1 = 2\n2 + 1 = 3\n#### 3\n",  # right (a trailing newline is no step)
    ]
    errors = load_toy().error_histogram(task, texts)
    assert errors == {
        "wrong": 3,
        "of": 5,
        "first_wrong_step": {1: 1, 2: 2},
        "wrong_rate_at_step": {1: 0.2, 2: 0.5},  # 1 of 5 at step 1; 2 of the 4 still right at step 2
    }


def test_steps_first_wrong_step_and_percentile():
    toy = load_toy()
    solution = "37 + 8 = 45\n45 - 5 = 40\n#### 40"
    assert toy.steps_of(solution + "\n\n") == ["37 + 8 = 45", "45 - 5 = 40", "#### 40"]
    assert toy.first_wrong_step(solution, solution) == 0
    assert toy.first_wrong_step("37 + 8 = 44\n44 - 5 = 39\n#### 39", solution) == 1
    assert toy.first_wrong_step("37 + 8 = 45\n45 - 5 = 41\n#### 41", solution) == 2
    assert toy.first_wrong_step("37 + 8 = 45\n45 - 5 = 40", solution) == 3  # stopped before the answer
    assert toy.first_wrong_step(solution + "\n40 + 1 = 41", solution) == 4  # went on past it
    assert toy.first_wrong_step("45", "45") == 0 and toy.first_wrong_step("46", "45") == 1  # arithmetic: one step
    assert toy.target({"answer": "45"}) == "45" and toy.target({"answer": "40", "solution": solution}) == solution
    values = list(range(1, 101))
    assert (toy.percentile(values, 0.5), toy.percentile(values, 0.95), toy.percentile(values, 1.0)) == (50, 95, 100)
    assert toy.percentile([7], 0.95) == 7


def test_chain_defaults_give_long_varied_responses_and_fit_the_model():
    """The chain toy policy's budget against its task's reference solutions: the response lengths RL meets from a
    policy that solves the problems as taught (reproduce/toy/README.md measures the built policies)."""
    toy = load_toy()
    chain = toy.TASK_DEFAULTS["chain"]
    tok, budget = toy.build_tokenizer(), chain["eval_max_new_tokens"]
    task = make_task("chain", digits=chain["digits"], eval_size=50)
    rows = [r for k in range(64) for r in task.train_rows(k, 32)]
    lengths = [len(tok(toy.target(r), add_special_tokens=False)["input_ids"]) + 1 for r in rows]  # + </s>
    capped = [min(n, budget) for n in lengths]
    median = toy.percentile(capped, 0.5)
    assert median >= 40 and toy.percentile(capped, 0.95) >= 2 * median
    assert 0.02 <= sum(n > budget for n in lengths) / len(lengths) <= 0.15
    assert sum(len(toy.steps_of(toy.target(r))) for r in rows) / len(rows) >= 4
    prompts = [len(encode_prompt(tok, task.prompt(r))) for r in rows + task.eval_rows]
    assert max(prompts) + max(budget, *lengths) <= chain["max_position_embeddings"]


def test_supervised_batches_cut_the_step_by_length_with_the_same_loss():
    import torch

    toy = load_toy()
    tok = toy.build_tokenizer()
    task = make_task("chain", digits=1, eval_size=8)
    rows = task.train_rows(0, 8)
    (whole,) = toy.supervised_batches(task, tok, rows)
    assert torch.equal(whole["input_ids"], toy.supervised_batch(task, tok, rows)["input_ids"])
    parts = toy.supervised_batches(task, tok, rows, 3)
    assert [len(b["input_ids"]) for b in parts] == [2, 3, 3]
    assert sum(int(b["response_mask"].sum()) for b in parts) == int(whole["response_mask"].sum())
    widths = [b["input_ids"].shape[1] for b in parts]
    assert widths == sorted(widths) and widths[0] < whole["input_ids"].shape[1]  # short rows, less padding
    config = toy.build_config(tok, 64, 1, 2, 1, 64, 384)
    models = [toy.build_model(config, seed=1) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    losses = [toy.supervised_step(m, o, b) for m, o, b in zip(models, optimizers, (whole, parts))]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6)


class Counter:
    """A stand-in for the warm start: the model is one number (the steps it has taken), the accuracy a table of it."""

    def __init__(self, table):
        import torch

        self.model = torch.nn.Linear(1, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.table = table
        with torch.no_grad():
            self.model.weight.zero_()

    def train_step(self, step):
        import torch

        assert step == self.taken()  # the replay starts from the restored state, at the step after it
        with torch.no_grad():
            self.model.weight += 1

    def taken(self):
        return int(round(self.model.weight.item()))

    def accuracy(self):
        return self.table(self.taken())


BAND = {"greedy": (0.28, 0.38)}


def test_train_into_band_stops_at_the_first_check_inside_the_band():
    c = Counter(lambda n: {"greedy": n / 100})
    steps, scores, checks = load_toy().train_into_band(c.model, c.optimizer, c.train_step, c.accuracy, BAND, 100, 10)
    assert (steps, scores, c.taken()) == (30, {"greedy": 0.30}, 30)
    assert checks == [{"step": s, "greedy": s / 100} for s in (10, 20, 30)]


def test_train_into_band_needs_every_band_at_the_same_check():
    c = Counter(lambda n: {"greedy": n / 100, "sampled": n / 200})  # sampled enters [0.22, 0.32] at step 44
    bands = {"greedy": (0.28, 0.50), "sampled": (0.22, 0.32)}
    steps, scores, _ = load_toy().train_into_band(c.model, c.optimizer, c.train_step, c.accuracy, bands, 100, 10)
    assert (steps, c.taken()) == (50, 50) and scores == {"greedy": 0.5, "sampled": 0.25}


def test_train_into_band_replays_step_by_step_after_a_check_jumps_over_the_band():
    c = Counter(lambda n: {"greedy": 0.1 if n < 27 else 0.3 if n < 29 else 0.6})
    steps, scores, checks = load_toy().train_into_band(c.model, c.optimizer, c.train_step, c.accuracy, BAND, 100, 10)
    assert (steps, scores, c.taken()) == (27, {"greedy": 0.3}, 27)  # weights and optimizer back to step 20, then 7
    assert [x["step"] for x in checks] == [10, 20, 30, 21, 22, 23, 24, 25, 26, 27]


def test_train_into_band_replays_coarsely_then_step_by_step():
    c = Counter(lambda n: {"greedy": 0.1 if n < 33 else 0.3 if n < 34 else 0.6})  # inside the band for one step
    steps, scores, checks = load_toy().train_into_band(
        c.model, c.optimizer, c.train_step, c.accuracy, BAND, 100, 20, replay_every=5
    )
    assert (steps, scores, c.taken()) == (33, {"greedy": 0.3}, 33)
    # 40 jumped over: back to 20, a check every 5 steps; 35 jumped over: back to 30, a check after every step
    assert [x["step"] for x in checks] == [20, 40, 25, 30, 35, 31, 32, 33]


def test_train_into_band_skips_what_was_not_measured():
    bands = {"greedy": (0.28, 0.38), "sampled": (0.22, 0.32)}
    c = Counter(lambda n: {"greedy": n / 100, "sampled": None if n < 28 else n / 120})  # measured from greedy 0.28
    steps, scores, checks = load_toy().train_into_band(c.model, c.optimizer, c.train_step, c.accuracy, bands, 100, 10)
    assert steps == 30 and scores == {"greedy": 0.3, "sampled": 0.25} and checks[0]["sampled"] is None
    never = Counter(lambda n: {"greedy": 0.1, "sampled": None})
    with pytest.raises(SystemExit, match=r"step 20: greedy 0.100, sampled -"):
        load_toy().train_into_band(never.model, never.optimizer, never.train_step, never.accuracy, bands, 20, 10)


def test_train_into_band_fails_clearly_when_it_never_lands():
    toy = load_toy()
    never = Counter(lambda n: {"greedy": 0.1})
    with pytest.raises(
        SystemExit,
        match=r"never landed in its bands \(greedy in \[0.28, 0.38\]\) within --max-steps 25"
        r".*step 25: greedy 0.100",
    ):
        toy.train_into_band(never.model, never.optimizer, never.train_step, never.accuracy, BAND, 25, 10)
    assert never.taken() == 25  # the cap is checked too, though not a multiple of --check-every
    jumps = Counter(lambda n: {"greedy": 0.1 if n < 25 else 0.9})  # over the band within one step: no replay lands
    with pytest.raises(SystemExit, match="never landed"):
        toy.train_into_band(jumps.model, jumps.optimizer, jumps.train_step, jumps.accuracy, BAND, 60, 10)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--digits", "0"], "--digits must be >= 1"),
        (["--band", "0.4", "0.3"], "--band 0.4 0.3: give LOW HIGH"),
        (["--sampled-band", "0.2", "1.5"], "--sampled-band 0.2 1.5: give LOW HIGH"),
        (["--hidden-size", "64", "--num-heads", "3"], "divisible"),
    ],
)
@pytest.mark.run
def test_bad_input_is_a_clear_error(tmp_path, flags, message):
    proc = run_script(SCRIPT, "--out", str(tmp_path / "toy"), *flags, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "toy").exists()


@pytest.mark.run
def test_refuses_to_replace_a_folder_that_is_not_a_toy_policy(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "keep.txt").write_text("mine")
    proc = run_script(
        SCRIPT, "--out", str(tmp_path / "toy"), "--digits", "1", *TINY, cwd=tmp_path, check=False, timeout=120
    )
    assert proc.returncode != 0 and "is not a toy policy" in proc.stderr
    assert (tmp_path / "toy" / "keep.txt").read_text() == "mine"
