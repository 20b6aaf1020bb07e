"""reproduce/toy/make_toy_policy.py: the character tokenizer and its chat template, a tiny build, and grpo.py on it."""

import importlib.util
import json

import pytest
from conftest import ROOT, TOY_SCRIPT as SCRIPT, TOY_TINY as TINY, run_script

from common.models import load_model, load_tokenizer, resolve_model
from common.tasks import encode_prompt, make_task
from common.tracking import read_metrics


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


def test_tiny_build_loads_and_records_its_warm_start(toy_path):
    path = resolve_model(str(toy_path))
    tok, model = load_tokenizer(path), load_model(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 1
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    manifest = json.loads((toy_path / "toy_policy.json").read_text())
    assert manifest["steps"] == 3 and manifest["digits"] == 1 and manifest["eval_size"] == 8
    assert 0.0 <= manifest["eval_accuracy"] <= 1.0 and manifest["warm_start_seconds"] >= 0


def test_grpo_runs_on_the_toy_policy(toy_path, tmp_path):
    run_script("grpo.py", "--model", str(toy_path), "--digits", "1", "--prompts-per-batch", "2", "--group-size", "4",
               "--max-new-tokens", "6", "--eval-size", "8", "--total-updates", "2", "--eval-every", "2",
               "--run-name", "toy", cwd=tmp_path)
    rows = read_metrics(tmp_path / "runs" / "toy" / "metrics.jsonl")
    assert [r["global_step"] for r in rows if "losses/policy_loss" in r] == [1, 2]
    assert "eval/accuracy" in rows[-1]


@pytest.mark.parametrize("flags,message", [
    (["--digits", "0"], "--digits must be >= 1"),
    (["--hidden-size", "64", "--num-heads", "3"], "divisible"),
])
def test_bad_input_is_a_clear_error(tmp_path, flags, message):
    proc = run_script(SCRIPT, "--out", str(tmp_path / "toy"), *flags, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "toy").exists()


def test_refuses_to_replace_a_folder_that_is_not_a_toy_policy(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "keep.txt").write_text("mine")
    proc = run_script(SCRIPT, "--out", str(tmp_path / "toy"), "--digits", "1", *TINY, cwd=tmp_path, check=False,
                      timeout=120)
    assert proc.returncode != 0 and "is not a toy policy" in proc.stderr
    assert (tmp_path / "toy" / "keep.txt").read_text() == "mine"
