"""MemPOConfig / MemPOTrainer construction: defaults follow the paper, bad combinations fail with a clear message."""

import doctest
import math
import warnings
from dataclasses import fields

import pytest
from datasets import Dataset
from trl import GRPOConfig

import mempo_trl.settings as settings_module
from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.commands.train_help import mempo_fields
from mempo_trl.context import DEFAULT_INSTRUCTION, ENVIRONMENT_INSTRUCTION
from mempo_trl.data import DataError
from mempo_trl.kit.envs import KeyVaultEnv, key_vault_rows
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.retrieval import Passage
from mempo_trl.settings import DynamicSamplingSettings, MemoryRewardSettings


BASE = dict(use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4)


class NoRetriever:
    def search(self, queries, topk):
        return [[Passage(id="0", title="t", text="x")] for _ in queries]


def test_paper_defaults(tmp_path):
    args = MemPOConfig(output_dir=str(tmp_path), **BASE)
    assert (args.max_turns, args.retrieval_topk, args.memory_coef) == (8, 3, 1.0)
    assert args.memory_threshold == pytest.approx(math.log(0.5))
    assert (args.context_mode, args.memory_pooling, args.memory_reward_type) == ("memory", "question", "diff")
    assert args.memory_scale_rewards == "group"
    assert not (args.memory_gate_on_outcome or args.memory_full_from_reference or args.memory_length_penalty)
    assert args.loss_type == "dapo"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(context_mode="everything"), "context_mode"),
        (dict(memory_threshold_quantile=0.3), "not both"),
        (dict(memory_threshold=None, memory_threshold_quantile=1.5), "memory_threshold_quantile"),
        (dict(memory_reward_type="ratio"), "memory_reward_type"),
        (dict(memory_length_penalty=-1.0), "memory_length_penalty"),
        (dict(memory_scale_rewards="question"), "memory_scale_rewards"),
        (dict(memory_pooling="round"), "memory_pooling"),
        (dict(memory_scoring="fast"), "memory_scoring"),
        (dict(max_turns=0), "max_turns"),
        (dict(retrieval_topk=0), "retrieval_topk"),
        (dict(instruction="no placeholder"), "{question}"),
    ],
)
def test_invalid_configs_fail_at_construction(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="Invalid MemPOConfig") as err:
        MemPOConfig(output_dir=str(tmp_path), **{**BASE, **overrides})
    assert message in str(err.value)


def _trainer(tiny_model_dir, tmp_path, dataset=None, **overrides):
    model, tokenizer = load_tiny(tiny_model_dir)
    dataset = dataset or Dataset.from_list([{"question": "q?", "golden_answers": ["x"]}])
    args = MemPOConfig(output_dir=str(tmp_path), **{**BASE, **overrides})
    return MemPOTrainer(model, NoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)


def test_trainer_rejects_bad_combinations(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a reference model"):
        _trainer(tiny_model_dir, tmp_path, memory_full_from_reference=True)
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        _trainer(tiny_model_dir, tmp_path, remove_unused_columns=True)
    with pytest.raises(DataError, match="golden_answers"):
        _trainer(tiny_model_dir, tmp_path, dataset=Dataset.from_list([{"question": "q?", "golden_answers": []}]))


def test_shared_prefix_scoring_follows_the_attention_implementation(tiny_model_dir, tmp_path):
    assert _trainer(tiny_model_dir, tmp_path).shared_prefix_scoring  # auto + sdpa
    model, tokenizer = load_tiny(tiny_model_dir)
    model.config._attn_implementation = "flash_attention_2"
    dataset = Dataset.from_list([{"question": "q?", "golden_answers": ["x"]}])
    auto = MemPOTrainer(
        model,
        NoRetriever(),
        args=MemPOConfig(output_dir=str(tmp_path), **BASE),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert not auto.shared_prefix_scoring
    with pytest.raises(ValueError, match="4D attention masks"):
        MemPOTrainer(
            model,
            NoRetriever(),
            args=MemPOConfig(output_dir=str(tmp_path), memory_scoring="shared_prefix", **BASE),
            train_dataset=dataset,
            processing_class=tokenizer,
        )


def test_single_token_action_tags_stop_generation(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path)
    tokenizer = trainer.processing_class
    for tag in ("</search>", "</answer>"):
        assert tokenizer.convert_tokens_to_ids(tag) in trainer.eos_token_ids
        assert tokenizer.convert_tokens_to_ids(tag) in trainer.generation_config.eos_token_id


def test_turn_and_memory_settings_have_one_home(tmp_path):
    """`MemPOConfig`'s own MemPO fields are exactly its homes' (`SETTINGS_HOMES`: `TurnProtocol`,
    `MemoryRewardSettings`, `DynamicSamplingSettings`, `LossForwardSettings`), take their default, help and choices
    from there (what `mempo-trl train --help` prints, read from the homes), and are handed out whole."""
    args = MemPOConfig(output_dir=str(tmp_path), **BASE)
    config_fields = {f.name: f for f in fields(MemPOConfig)}
    own = set(config_fields) - {f.name for f in fields(GRPOConfig)}
    declared = mempo_fields()
    assert own == {f.name for f in declared}
    for f in declared:
        assert config_fields[f.name].default == f.default, f.name
        assert config_fields[f.name].metadata["help"] == f.metadata["help"], f.name
        assert config_fields[f.name].metadata.get("choices") is f.metadata.get("choices"), f.name  # a registry's: live
    assert args.dynamic_sampling_settings() == DynamicSamplingSettings()
    assert args.memory_settings() == MemoryRewardSettings()
    custom = MemPOConfig(output_dir=str(tmp_path), memory_pooling="question_round", max_turns=3, **BASE)
    assert custom.memory_settings().memory_pooling == "question_round"
    assert custom.turn_protocol().max_turns == 3
    assert custom.turn_protocol(environment=True).action == "tool_call"


def test_the_trainer_leaves_the_callers_config_alone(tiny_model_dir, tmp_path):
    """The trainer changes `instruction` for an environment (and `generation_kwargs` with vLLM) on its own copy."""
    model, tokenizer = load_tiny(tiny_model_dir)
    args = MemPOConfig(output_dir=str(tmp_path), hub_token="hf_secret", **BASE)
    before = vars(args).copy()
    trainer = MemPOTrainer(
        model,
        environment_factory=KeyVaultEnv,
        args=args,
        train_dataset=Dataset.from_list(key_vault_rows(4)),
        processing_class=tokenizer,
    )
    assert trainer.args.instruction == ENVIRONMENT_INSTRUCTION
    assert args.instruction == DEFAULT_INSTRUCTION and trainer.args is not args
    assert trainer.args.hub_token == "hf_secret"  # the copy keeps what pickling leaves out
    assert {k: v for k, v in vars(args).items() if k in before} == before


def test_settings_doctests():
    assert doctest.testmod(settings_module).failed == 0


@pytest.mark.parametrize(
    ("sampling", "named"),
    [({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 50}, "top_k=50"), ({"min_p": 0.05}, "min_p=0.05")],
)
def test_truncated_sampling_with_vllms_importance_correction_is_announced(sampling, named):
    """vLLM's log-probs under top_p/top_k/min_p are renormalised over the kept tokens, the trainer's are not: TRL's
    importance-sampling ratio is then scaled by the kept mass (trl#6789). Said at config time, with the fix; silent
    without vLLM, without truncation, or with the correction off."""
    base = {"use_cpu": True, "bf16": False}
    with pytest.warns(UserWarning, match=rf"{named} with vLLM: TRL's importance-sampling ratio .*trl#6789"):
        MemPOConfig("out", use_vllm=True, **base, **sampling)
    quiet = [
        {"use_vllm": False, **sampling},
        {"use_vllm": True},
        {"use_vllm": True, "vllm_importance_sampling_correction": False, **sampling},
    ]
    for settings in quiet:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*trl#6789")
            MemPOConfig("out", **base, **settings)


def test_truncated_sampling_is_said_by_the_runs_first_process_only(monkeypatch):
    """Said once per run: not again by a process of rank > 0, nor by one a `mempo-trl train` launcher started (it
    said it; `HELD_ENV` marks its processes)."""
    from mempo_trl.outputs import HELD_ENV

    settings = {"use_cpu": True, "bf16": False, "use_vllm": True, "top_k": 20}
    for env in ({"RANK": "1"}, {HELD_ENV: "/runs/out"}):
        with monkeypatch.context() as patch, warnings.catch_warnings():
            for name, value in env.items():
                patch.setenv(name, value)
            warnings.filterwarnings("error", message=".*trl#6789")
            MemPOConfig("out", **settings)
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="top_k=20 with vLLM"):
        MemPOConfig("out", **settings)
