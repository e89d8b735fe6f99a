"""Every named choice is a registry (`mempo_trl.registry`): a setting's choices are its keys, live (a variant
registered later is a choice), and its help text is generated from the registry, so it lists what the registry holds
and no help string names a variant by hand."""

import math
from dataclasses import fields

import pytest
import torch

from mempo_trl.config import MemPOConfig
from mempo_trl.context import CONTEXT_RULES
from mempo_trl.memory import memory_reward, memory_scores
from mempo_trl.memory_rewards import MEMORY_REWARDS, PART_REWARDS, register_memory_reward
from mempo_trl.protocol import TurnProtocol
from mempo_trl.registry import Registry
from mempo_trl.settings import MemoryRewardSettings


REGISTRIES = [
    (MemoryRewardSettings, "memory_reward_type", MEMORY_REWARDS),
    (MemoryRewardSettings, "memory_reward_parts", PART_REWARDS),
    (TurnProtocol, "context_mode", CONTEXT_RULES),
]


def _field(source, name):
    return next(f for f in fields(source) if f.name == name)


@pytest.mark.parametrize("source, name, registry", REGISTRIES, ids=[name for _, name, _ in REGISTRIES])
def test_a_setting_offers_its_registry_and_its_help_lists_it(source, name, registry):
    for home in (source, MemPOConfig):
        meta = _field(home, name).metadata
        assert tuple(meta["choices"]) == tuple(registry)
        for choice, help in registry.helps.items():
            assert f"`{choice}`: {help}" in meta["help"]


def test_a_registered_variant_is_a_choice_and_is_computed():
    register_memory_reward("relative", lambda p_mem, p_full, eps: (p_mem - p_full) / (p_full + eps), "relative gap")
    try:
        assert MemoryRewardSettings(memory_reward_type="relative").memory_reward_type == "relative"
        assert "`relative`: relative gap" in MEMORY_REWARDS.help_text()
        assert memory_reward(torch.tensor([0.6]), torch.tensor([0.4]), "relative", 0.0).item() == pytest.approx(0.5)
    finally:
        del MEMORY_REWARDS["relative"], MEMORY_REWARDS.helps["relative"]
    with pytest.raises(ValueError, match=r"memory_reward_type must be one of \('diff', 'log_ratio'\)"):
        MemoryRewardSettings(memory_reward_type="relative")


def test_the_answer_parts_rules_are_resolved_from_the_registry():
    """`joint` is one P (the geometric mean) over all gold tokens, `weakest` the lowest part: P_full 0.9/0.5 and
    P_mem 0.9/0.1 per part."""
    full = (torch.log(torch.tensor([[0.9, 0.5]])), torch.ones(1, 2))
    mem = (torch.log(torch.tensor([[0.9, 0.1]])), torch.ones(1, 2))
    parts = torch.tensor([[1, 2]])
    rewards = {
        name: memory_scores(1, [0], full, mem, [0], MemoryRewardSettings(memory_reward_parts=name), None, 1, parts)
        .reward[0]
        .item()
        for name in PART_REWARDS
    }
    joint = math.sqrt(0.9 * 0.1) - math.sqrt(0.9 * 0.5)
    assert rewards == pytest.approx({"joint": joint, "weakest": 0.1 - 0.5, "losses": (0 - 0.4) / 2})


def test_a_taken_name_or_an_unknown_one_is_refused_naming_the_choices():
    registry = Registry("colour")
    registry.register("red", 1, "warm")
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        registry.register("red", 2, "hot")
    with pytest.raises(ValueError, match=r"colour must be one of \('red',\), got 'blue'"):
        registry.resolve("blue")


def test_the_generation_backends_are_a_registry(tiny_model_dir):
    """`MemPOAgent.from_pretrained` builds its generator by name (`make_generator`); an unknown name is refused naming
    the registered ones."""
    from mempo_trl.generation import GENERATORS, GeneratorOptions, HFGenerator, make_generator
    from mempo_trl.kit.tiny import load_tiny

    assert tuple(GENERATORS) == ("transformers", "vllm", "openai")
    tokenizer = load_tiny(tiny_model_dir)[1]
    protocol = TurnProtocol(max_completion_length=7)
    generator = make_generator(
        "transformers", str(tiny_model_dir), tokenizer, protocol, GeneratorOptions(device="cpu")
    )
    assert isinstance(generator, HFGenerator) and generator.max_new_tokens == 7
    with pytest.raises(ValueError, match=r"generation backend must be one of \('transformers', 'vllm', 'openai'\)"):
        make_generator("tgi", str(tiny_model_dir), tokenizer, protocol, GeneratorOptions())
