"""Launching training: recipes, accelerate configs, the start banner, and real 2-process CPU launches.

The launches run `examples/train_mempo.py` through `accelerate launch` with the CPU configs of
`accelerate_configs/` and check what really ran (from the `mempo-trl:` banner), not only the exit code: a wrong
launcher config exits 0 while training independent copies. DeepSpeed JIT-compiles its shm comm op on first use
(1-2 min on 2 cores), cached in `$TORCH_EXTENSIONS_DIR` (CI sets it); the venv's `bin/` goes first on PATH so that
the same `ninja` builds it every time (another ninja rebuilds the cached op).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import free_port

from mempo_trl.kit.demo_world import demo_paths


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_mempo.py"
DEMO = demo_paths()
RECIPES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
GPU_RECIPES = [ROOT / "examples" / "configs" / name for name in ("qwen2.5-3b-lora.yaml", "qwen2.5-7b-vllm.yaml")]
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
LAUNCH_TIMEOUT_S = 1200  # a cold DeepSpeed op build on a busy 2-core runner included


# ---------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_with_trl_parser(recipe):
    from mempo_trl.commands.train import parse_args

    # use_cpu: the GPU recipes set bf16, which TrainingArguments rejects on a machine without a GPU otherwise.
    script_args, training_args, model_args, retriever_args = parse_args(["--config", str(recipe), "--use_cpu", "true"])
    assert model_args.model_name_or_path
    assert training_args.loss_type == "dapo"
    assert training_args.generation_batch_size % training_args.num_generations == 0


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipes_have_the_paper_settings(recipe):
    from mempo_trl.commands.train import parse_args

    script_args, training_args, model_args, retriever_args = parse_args(["--config", str(recipe), "--use_cpu", "true"])
    assert model_args.model_name_or_path.startswith("Qwen/Qwen2.5-")
    assert model_args.dtype == "bfloat16" and training_args.bf16
    assert (training_args.num_generations, training_args.max_turns, training_args.retrieval_topk) == (16, 8, 3)
    assert training_args.memory_threshold == pytest.approx(math.log(0.5))
    assert training_args.memory_coef == 1.0
    assert training_args.activation_checkpointing
    assert script_args.dataset_name and (retriever_args.retriever_url or retriever_args.corpus)
    # Trajectories per generation on 8 GPUs form whole groups of G.
    per_generation_on_8 = training_args.per_device_train_batch_size * 8 * training_args.steps_per_generation
    assert per_generation_on_8 % training_args.num_generations == 0
    text = recipe.read_text()
    assert "ESTIMATES" in text and "GB" in text


def test_3b_recipe_is_lora_and_7b_recipe_is_full_with_vllm_colocate():
    from mempo_trl.commands.train import parse_args

    _, lora_args, lora_model, _ = parse_args(["--config", str(GPU_RECIPES[0]), "--use_cpu", "true"])
    assert lora_model.use_peft and lora_model.lora_target_modules == "all-linear" and not lora_args.use_vllm
    _, vllm_args, full_model, _ = parse_args(["--config", str(GPU_RECIPES[1]), "--use_cpu", "true"])
    assert not full_model.use_peft
    assert vllm_args.use_vllm and vllm_args.vllm_mode == "colocate"
    assert 0 < vllm_args.vllm_gpu_memory_utilization < 0.5
    assert vllm_args.vllm_max_model_length >= 2048
    assert lora_args.disable_dropout and vllm_args.disable_dropout  # LoRA dropout 0.05 would make P_mem noisy


# ---------------------------------------------------------------------------------------------- accelerate configs


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_and_documents_its_use(config):
    from accelerate.commands.config.config_args import load_config_from_file

    assert config.read_text().startswith("#"), "every config starts with a comment saying what it is for"
    cluster = load_config_from_file(str(config))
    assert cluster.distributed_type.value in ("NO", "MULTI_GPU", "DEEPSPEED")
    if config.name.startswith("cpu_"):
        # 2 processes through torchrun; `use_cpu` must come from the recipe, never from here (one process then).
        assert cluster.num_processes == 2 and not cluster.use_cpu and cluster.mixed_precision == "no"
        assert cluster.distributed_type.value != "NO"
    else:
        assert cluster.mixed_precision == "bf16"
    if "zero3" in config.name or config.name == "multi_node.yaml":
        assert cluster.deepspeed_config["zero_stage"] == 3 and cluster.deepspeed_config["zero3_save_16bit_model"]
    if config.name == "multi_node.yaml":
        assert cluster.num_machines > 1 and cluster.num_processes % cluster.num_machines == 0
        assert cluster.main_process_ip and cluster.main_process_port


def test_cpu_ddp_config_uses_the_multi_gpu_launcher_and_says_why():
    text = (ROOT / "accelerate_configs" / "cpu_ddp.yaml").read_text()
    assert yaml.safe_load(text)["distributed_type"] == "MULTI_GPU"
    assert "MULTI_CPU" in text and "ONE process" in text and "use_cpu: true" in text


# ---------------------------------------------------------------------------------------------- console output


def test_describe_model_names_wrapper_and_model():
    from mempo_trl.callbacks import describe_model

    inner = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Sequential(inner)
    assert describe_model(wrapper, inner) == "Sequential(Linear)"
    assert describe_model(inner, inner) == describe_model(None, inner) == "Linear"


def test_launch_warnings_catch_the_silent_fallbacks():
    from mempo_trl.callbacks import launch_warnings

    assert launch_warnings(2, "MULTI_CPU", {"WORLD_SIZE": "2"}) == []
    assert launch_warnings(1, "NO", {}) == []
    (independent,) = launch_warnings(1, "NO", {"WORLD_SIZE": "2"})
    assert "independent copies" in independent and "use_cpu: true" in independent
    (not_deepspeed,) = launch_warnings(2, "MULTI_CPU", {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"})
    assert "DeepSpeed" in not_deepspeed and "MULTI_CPU" in not_deepspeed
    assert launch_warnings(2, "DEEPSPEED", {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}) == []


def test_step_summary_line():
    from mempo_trl.callbacks import format_step_summary

    logs = {
        "reward": 0.3125,
        "episode/em": 0.25,
        "episode/format_valid": 1.0,
        "memory/reward": -0.0213,
        "tokens/prompt_per_round": 412.52,
        "step_time": 14.2,
    }
    assert format_step_summary(3, 200, logs) == (
        "step 3/200 | reward 0.312 | em 0.250 | format 1.000 | mem_reward -0.021 | prompt/round 412.5 | 14.20 s/step"
    )
    assert format_step_summary(1, 1, {"reward": 0.0}).endswith("mem_reward - | prompt/round - | - s/step")


# ---------------------------------------------------------------------------------------------- 2-process launches


def _launch(accelerate_config: str, model_dir: Path, out: Path, *extra: str) -> str:
    """`accelerate launch` examples/train_mempo.py on the demo world for 2 MemPO steps; return its output."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / accelerate_config),
        "--main_process_port",
        str(free_port()),
        str(SCRIPT),
        "--config",
        str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"),
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(DEMO.train.parent),
        "--corpus",
        str(DEMO.corpus),
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "2",
        "--num_generations",
        "2",  # 2 x 2 processes = 2 groups of G=2
        "--max_turns",
        "2",
        "--max_completion_length",
        "24",
        "--max_steps",
        "2",
        *extra,
    ]
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def _banner(output: str) -> dict[str, str]:
    (line,) = re.findall(r"mempo-trl: (world_size=.*)", output)  # rank 0 only
    assert "mempo-trl: WARNING" not in output
    return dict(item.split("=", 1) for item in line.split())


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_zero2_two_processes_full_model(warm_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "zero2"
    output = _launch("cpu_zero2.yaml", warm_model_dir, out)
    banner = _banner(output)
    assert banner["world_size"] == "2" and banner["distributed_type"] == "DEEPSPEED"
    assert banner["model"] == "DeepSpeedEngine(Qwen2ForCausalLM)" and banner["zero_stage"] == "2"
    assert f"model saved to {out}" in output
    assert re.search(r"step 2/2 \| reward ", output)
    trained = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    assert _changed(trained.state_dict(), base.state_dict())


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_zero3_two_processes_lora_then_merge(warm_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    out = tmp_path / "zero3_lora"
    lora = ("--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj")
    output = _launch("cpu_zero3.yaml", warm_model_dir, out, *lora)
    banner = _banner(output)
    assert banner["world_size"] == "2" and banner["distributed_type"] == "DEEPSPEED"
    assert banner["model"] == "DeepSpeedEngine(PeftModelForCausalLM)" and banner["zero_stage"] == "3"
    # The tiny recipe's held-out evaluation generates on one process: skipped, as a ZeRO-3 forward is collective.
    assert "heldout_questions=50 is skipped on 2 processes" in output
    assert f"model saved to {out}" in output
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0: it trained

    merged_dir = tmp_path / "merged"
    merge = subprocess.run(
        [
            sys.executable,
            "-m",
            "mempo_trl",
            "merge-lora",
            "--model_name_or_path",
            str(out),
            "--output_dir",
            str(merged_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merge.returncode == 0, merge.stdout[-3000:] + merge.stderr[-3000:]
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokenizer = load_tokenizer(merged_dir)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model_dir), out).eval()
    inputs = tokenizer("Where is the headquarters of Gamma?", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, with_adapter(**inputs).logits, atol=1e-4, rtol=1e-4)
        generated = merged.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes(warm_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ddp"
    output = _launch("cpu_ddp.yaml", warm_model_dir, out)
    banner = _banner(output)
    assert banner["world_size"] == "2" and banner["distributed_type"] == "MULTI_CPU"
    assert banner["model"] == "DistributedDataParallel(Qwen2ForCausalLM)"
    assert f"model saved to {out}" in output
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"


# ---------------------------------------------------------------------------------------------- merge-lora


def test_merge_lora_with_moved_base_and_dtype(tiny_model_dir, tmp_path):
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mempo_trl.kit.tiny import load_tiny
    from mempo_trl.merge import merge_lora
    from mempo_trl.protocol import TurnProtocol

    model, tokenizer = load_tiny(tiny_model_dir)
    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)  # no tokenizer here: the base model's is used
    TurnProtocol(max_turns=5).save(adapter)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(tmp_path / "moved")
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config))

    out = merge_lora(adapter, tmp_path / "merged", base=str(tiny_model_dir), dtype="bfloat16")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert merged.dtype == torch.bfloat16
    assert not any("lora" in name for name in merged.state_dict())
    assert (out / "tokenizer.json").is_file()
    assert TurnProtocol.from_pretrained(out).max_turns == 5  # the agent's settings travel with the merged model
    inputs = tokenizer("Where is Gamma?", return_tensors="pt")
    with torch.no_grad():
        expected = peft_model(**inputs).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(**inputs).logits
        assert (expected - base_logits).abs().max() > 0.2  # the adapter matters, far beyond the bf16 tolerance below
        torch.testing.assert_close(merged(**inputs).logits.float(), expected, atol=0.02, rtol=0.02)


def test_merge_finds_the_base_model_that_moved_with_the_run(tmp_path):
    from mempo_trl.commands.merge import resolve_base_model, write_merged_card

    run = tmp_path / "moved_run"
    (run / "base_model").mkdir(parents=True)
    (run / "base_model" / "config.json").write_text("{}")
    assert resolve_base_model(run, str(tmp_path / "gone" / "base_model")) == str(run / "base_model")
    assert resolve_base_model(run, str(run / "base_model")) == str(run / "base_model")
    assert resolve_base_model(tmp_path, "Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"
    with pytest.raises(FileNotFoundError, match="--base_model_name_or_path"):
        resolve_base_model(tmp_path, str(tmp_path / "gone"))

    (run / "README.md").write_text(
        f'---\ntags:\n- mempo\n---\n\n# Model Card for run\n\nfrom_pretrained("{run}", retriever="c.jsonl")\n'
    )
    merged = tmp_path / "merged"
    merged.mkdir()
    write_merged_card(run, str(run / "base_model"), merged)
    card = (merged / "README.md").read_text()
    assert card.startswith("---\ntags:\n- mempo\n---\n")
    assert "merged into its base model" in card and f'from_pretrained("{merged}"' in card
