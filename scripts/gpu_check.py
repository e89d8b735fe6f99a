"""GPU check: one LoRA + vLLM-colocate MemPO step, and proof that the adapter reaches vLLM.

    bash scripts/gpu_check.sh            # on a CUDA machine with `pip install -e ".[vllm]"`

Builds the offline tiny model (wider than the test one: vLLM's kernels want head_dim >= 32) and warm-starts it on
the MemPO format, then trains MemPO with LoRA and `use_vllm=True, vllm_mode="colocate"`. Before and after the
update it asks the colocated vLLM engine for the prompt log-probs of a fixed sequence; the check passes when they
move after the LoRA update has been synced (TRL syncs weights at the first generation of a new step).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from mempo_trl import MemPOConfig, MemPOTrainer
from mempo_trl.data import load_qa
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.kit.warmstart import build_warm_tiny_model
from mempo_trl.retrieval import BM25Retriever


def prompt_logprobs(trainer, ids: list[int]) -> list[float]:
    """vLLM's log p of every token of ``ids`` after the first, from the colocated engine."""
    out = trainer.vllm_generation.llm.generate(
        TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]


def main(out_dir: str) -> int:
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    model_dir = build_warm_tiny_model(Path(out_dir) / "tiny", seed=0)
    model, tokenizer = load_tiny(model_dir)
    args = MemPOConfig(
        output_dir=str(Path(out_dir) / "run"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=4096,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        max_turns=3,
        learning_rate=5e-3,
        max_steps=2,
        bf16=True,
        activation_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = MemPOTrainer(
        model.to("cuda"),
        BM25Retriever.from_corpus(demo_paths().corpus),
        args=args,
        train_dataset=load_qa(str(demo_paths().train)).select(range(32)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    probe = tokenizer("<mem>Tisdin Purbro</mem><think>search</think><search>Tisdin Purbro born</search>")["input_ids"]
    trainer.vllm_generation.sync_weights()
    before = prompt_logprobs(trainer, probe)
    trainer.train()
    trainer.vllm_generation.sync_weights()
    after = prompt_logprobs(trainer, probe)
    moved = max(abs(a - b) for a, b in zip(before, after))
    metrics = trainer.final_metrics()
    report = {"max_logprob_change": moved, "steps": trainer.state.global_step, **metrics}
    print(json.dumps(report, indent=2))
    if moved <= 1e-4:
        print("FAIL: vLLM's log-probs did not move: the LoRA update did not reach the sampler", file=sys.stderr)
        return 1
    print("PASS: the LoRA update reached vLLM")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()))
