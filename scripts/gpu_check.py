"""GPU check: LoRA + vLLM-colocate MemPO steps, proof that the adapter reaches vLLM, and the vLLM bookkeeping.

    bash scripts/gpu_check.sh            # on a CUDA machine with vllm installed (`pip install -e ".[vllm]"`)

Builds the offline tiny model with head_dim 32 (hidden 128, 4 heads: vLLM's Triton attention wants head_dim >= 32)
and warm-starts it on the MemPO format, then trains MemPO for 2 steps with LoRA and `use_vllm=True,
vllm_mode="colocate"`. Checks, reported as one JSON line with "result": "PASS" or "FAIL":

- the prompt log-probs of a fixed sequence, asked from the colocated engine before and after training, moved (the
  LoRA update reached vLLM);
- exactly one weight sync per step inside the training loop (TRL syncs at the first generation of a step, before
  round 1; MemPO's later rounds reuse it);
- TRL's importance-sampling metrics are logged and close to 1 (vLLM and the trainer score the same rows).
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
from mempo_trl.kit.tiny import build_tiny_model, load_tiny
from mempo_trl.kit.warmstart import demo_data, sft_warm_start, tiny_warm_settings
from mempo_trl.retrieval import BM25Retriever


def prompt_logprobs(trainer, ids: list[int]) -> list[float]:
    """vLLM's log p of every token of ``ids`` after the first, from the colocated engine."""
    out = trainer.vllm_generation.llm.generate(
        TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]


def main(out_dir: str) -> int:
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    model_dir = Path(out_dir) / "tiny"
    build_tiny_model(model_dir, seed=0, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    sft_warm_start(model_dir, *demo_data(), tiny_warm_settings(seed=0))
    model, tokenizer = load_tiny(model_dir)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
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
    syncs = []
    sync_weights = trainer.vllm_generation.sync_weights
    trainer.vllm_generation.sync_weights = lambda: (syncs.append(trainer.state.global_step), sync_weights())[1]
    trainer.train()
    trainer.vllm_generation.sync_weights = sync_weights
    sync_weights()
    after = prompt_logprobs(trainer, probe)
    moved = max(abs(a - b) for a, b in zip(before, after))
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    ratios = [entry.get("sampling/importance_sampling_ratio/mean", float("nan")) for entry in steps]
    checks = {
        "head_dim_at_least_32": head_dim >= 32,
        "lora_update_reached_vllm": moved > 1e-4,
        "one_weight_sync_per_step": syncs == list(range(args.max_steps)),
        "is_ratio_near_1": len(ratios) == args.max_steps and all(0.8 < r < 1.25 for r in ratios),
    }
    report = {
        "result": "PASS" if all(checks.values()) else "FAIL",
        "checks": checks,
        "head_dim": head_dim,
        "max_logprob_change": moved,
        "weight_syncs_at_steps": syncs,
        "is_ratio_mean": ratios,
        "logp_difference_mean": [entry.get("sampling/sampling_logp_difference/mean") for entry in steps],
        "steps": trainer.state.global_step,
    }
    print(json.dumps(report))
    return 0 if report["result"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()))
