"""MemPO (Self-Memory Policy Optimization) for search agents on Hugging Face TRL.

Public names are imported lazily, so that `import mempo_trl` (and the `mempo-trl` CLI) stays fast.
"""

import importlib


__version__ = "0.1.0"

_EXPORTS = {
    "MemPOConfig": "mempo_trl.config",
    "MemPOTrainer": "mempo_trl.trainer",
    "RolloutEngine": "mempo_trl.rollout",
    "Task": "mempo_trl.tasks",
    "SearchTask": "mempo_trl.tasks",
    "EnvironmentTask": "mempo_trl.tasks",
    "check_environment": "mempo_trl.environments",
    "load_environment": "mempo_trl.environments",
    "tool_schemas": "mempo_trl.environments",
    "Episode": "mempo_trl.rollout",
    "TrainingRow": "mempo_trl.rollout",
    "initial_messages": "mempo_trl.context",
    "round_messages": "mempo_trl.context",
    "register_context_rule": "mempo_trl.context",
    "register_memory_reward": "mempo_trl.memory_rewards",
    "register_part_reward": "mempo_trl.memory_rewards",
    "register_generator": "mempo_trl.generation",
    "parse_turn": "mempo_trl.turns",
    "Turn": "mempo_trl.turns",
    "render_information": "mempo_trl.context",
    "render_gold_answer": "mempo_trl.context",
    "locate_mem_span": "mempo_trl.offsets",
    "normalize_answer": "mempo_trl.rewards",
    "exact_match": "mempo_trl.rewards",
    "f1_score": "mempo_trl.rewards",
    "outcome_score": "mempo_trl.rewards",
    "episode_outcome": "mempo_trl.rewards",
    "episode_metrics": "mempo_trl.rewards",
    "mempo_outcome_reward": "mempo_trl.rewards",
    "mempo_all_parts_reward": "mempo_trl.rewards",
    "mempo_format_reward": "mempo_trl.rewards",
    "answer_probability": "mempo_trl.memory",
    "memory_reward": "mempo_trl.memory",
    "group_outcome_advantages": "mempo_trl.advantages",
    "mempo_advantages": "mempo_trl.advantages",
    "MemoryRewardSettings": "mempo_trl.settings",
    "zero_std_groups": "mempo_trl.dynamic_sampling",
    "Passage": "mempo_trl.retrieval",
    "BM25Retriever": "mempo_trl.retrieval",
    "HttpRetriever": "mempo_trl.retrieval",
    "load_retriever": "mempo_trl.retrieval",
    "RetrievalError": "mempo_trl.retrieval",
    "RetrieverOutage": "mempo_trl.retrieval",
    "RetrieverArguments": "mempo_trl.retrieval",
    "build_retriever": "mempo_trl.retrieval",
    "load_qa": "mempo_trl.data",
    "DataError": "mempo_trl.data",
    "compose_objectives": "mempo_trl.compose",
    "convert_hotpotqa": "mempo_trl.hotpotqa",
    "load_tokenizer": "mempo_trl.loading",
    "check_model_files": "mempo_trl.loading",
    "check_adapter_files": "mempo_trl.loading",
    "evaluate": "mempo_trl.evaluation",
    "evaluate_objectives": "mempo_trl.sweep",
    "build_page": "mempo_trl.viewer",
    "MemPOAgent": "mempo_trl.agent",
    "TurnProtocol": "mempo_trl.protocol",
    "AgentResult": "mempo_trl.agent",
    "OpenAIChatGenerator": "mempo_trl.endpoint",
    "distill": "mempo_trl.distill",
    "OracleTeacher": "mempo_trl.oracle",
    "CheckpointError": "mempo_trl.checkpoints",
    "validate_checkpoint": "mempo_trl.checkpoints",
    "newest_complete_checkpoint": "mempo_trl.checkpoints",
    "SaveOnSignalCallback": "mempo_trl.interruptions",
    "TrainingStopped": "mempo_trl.interruptions",
    "NonFiniteError": "mempo_trl.interruptions",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mempo_trl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
