"""Tiny offline model kit: reload round trip, determinism, tag tokens, chat template, CLI.

Run: `pytest tests/test_tiny.py`
"""

import doctest
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

import mempo_trl.kit.tiny as tiny_module
from mempo_trl.cli import main
from mempo_trl.kit.tiny import build_tiny_model, load_tiny
from mempo_trl.loading import load_tokenizer
from mempo_trl.turns import MEMPO_TAGS


TEXT = "<mem> Pansik Textiles was founded in 1834. </mem>\n<think> search </think>\n<search> founder </search>"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who founded Pansik Textiles?"},
    {
        "role": "assistant",
        "content": "<mem> none </mem>\n<think> look up </think>\n<search> Pansik Textiles </search>",
    },
    {"role": "tool", "content": "<information>Doc 1(Title: Pansik Textiles) founded by Ada Lark</information>"},
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


def logits_of(model, tokenizer):
    with torch.no_grad():
        return model(**tokenizer(TEXT, return_tensors="pt")).logits


def test_doctests(tiny):
    # Needs a loaded model first: the first load of a process logs an accelerator line that doctest would see.
    assert doctest.testmod(tiny_module).failed == 0


def test_config_shape(tiny):
    model, tokenizer = tiny
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings and config.max_position_embeddings == 4096
    assert config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_special_tokens_and_generation_config(tiny):
    model, tokenizer = tiny
    assert tokenizer.padding_side == "left"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert "<|im_start|>" in tokenizer.all_special_tokens
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id]
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id


def test_reload_round_trip_and_same_seed_rebuild(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    reloaded, reloaded_tokenizer = load_tiny(tiny_model_dir)
    assert reloaded_tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert torch.equal(logits_of(model, tokenizer), logits_of(reloaded, reloaded_tokenizer))

    rebuilt = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja"):
        assert (rebuilt / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other_model, other_tokenizer = load_tiny(rebuilt)
    assert torch.equal(logits_of(model, tokenizer), logits_of(other_model, other_tokenizer))


def test_build_is_identical_in_another_process(tiny_model_dir, tmp_path):
    code = f"from mempo_trl.kit.tiny import build_tiny_model; build_tiny_model({str(tmp_path)!r}, seed=0)"
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    for name in ("tokenizer.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tiny_model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    base, changed = load_file(tiny_model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert base.keys() == changed.keys()
    assert not torch.equal(base["model.embed_tokens.weight"], changed["model.embed_tokens.weight"])


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path, seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("tag", MEMPO_TAGS)
def test_each_tag_is_one_token_that_survives_skip_special(tiny, tag):
    _, tokenizer = tiny
    ids = tokenizer(tag, add_special_tokens=False).input_ids
    assert len(ids) == 1
    assert tag not in tokenizer.all_special_tokens
    text = f"a{tag}b {tag} c"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert ids[0] in tokenizer(f"x {tag}y").input_ids


def test_eos_is_dropped_by_skip_special(tiny):
    _, tokenizer = tiny
    ids = tokenizer("<answer> 1834 </answer><|im_end|>").input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<answer> 1834 </answer>"


def test_auto_tokenizer_agrees_on_ids(tiny, tiny_model_dir):
    # AutoTokenizer swaps in Qwen2Tokenizer (its own pre-tokenizer); the tiny tokenizer is built to match it.
    _, tokenizer = tiny
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    text = TEXT + "  3,566 metres\n\n it's"
    assert auto(text).input_ids == tokenizer(text).input_ids == load_tokenizer(tiny_model_dir)(text).input_ids


def test_numbers_are_one_token_per_digit(tiny):
    _, tokenizer = tiny
    assert [tokenizer.decode([i]) for i in tokenizer(" 1834").input_ids] == [" ", "1", "8", "3", "4"]


def test_chat_template_roles(tiny):
    _, tokenizer = tiny
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWho founded Pansik Textiles?<|im_end|>\n"
        "<|im_start|>assistant\n<mem> none </mem>\n<think> look up </think>\n<search> Pansik Textiles </search>"
        "<|im_end|>\n"
        # the tool role is rendered as a user turn wrapping the content in <tool_response>
        "<|im_start|>user\n<tool_response>\n<information>Doc 1(Title: Pansik Textiles) founded by Ada Lark"
        "</information>\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False)
    assert no_prompt.endswith("Who founded Pansik Textiles?<|im_end|>\n")
    # Without a system message the template inserts Qwen's default one.
    no_system = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False)
    assert no_system.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_left_padding_batch(tiny):
    model, tokenizer = tiny
    batch = tokenizer(["Who founded Pansik Textiles?", "Hi"], padding=True, return_tensors="pt")
    assert batch.input_ids[1, 0] == tokenizer.pad_token_id and batch.attention_mask[1, 0] == 0
    assert batch.attention_mask[:, -1].all()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, batch.input_ids.shape[1] + 3)


def test_custom_corpus_and_cli(tmp_path, capsys):
    custom = build_tiny_model(tmp_path / "custom", corpus_texts=["Zorblat zorblat zorblat quux"] * 50)
    assert len(load_tokenizer(custom)(" zorblat").input_ids) == 1
    assert main(["kit", "build-tiny-model", "--output_dir", str(tmp_path / "cli"), "--seed", "0"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"]
