"""The packaged launch path (`mempo-trl train --accelerate_config NAME --num_processes N`), the short `--help`, and
the output-directory refusal that comes before torch and TRL are imported."""

import doctest
import logging
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import trl
import yaml

from mempo_trl.commands import launch as launch_module
from mempo_trl.commands.launch import (
    check_cpu_config,
    check_machines,
    launch_command,
    packaged_accelerate_configs,
    quiet_launcher_logs,
    resolve_accelerate_config,
    split_launch_args,
)
from mempo_trl.protocol import TurnProtocol
from mempo_trl.settings import DynamicSamplingSettings, MemoryRewardSettings


ROOT = Path(__file__).resolve().parents[1]


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_split_launch_args_keeps_the_training_arguments_in_order():
    launch, rest = split_launch_args(
        ["--config", "r.yaml", "--num_processes", "2", "--max_steps", "1", "--accelerate_config=cpu_zero3"]
    )
    assert launch == {"--num_processes": "2", "--accelerate_config": "cpu_zero3"}
    assert rest == ["--config", "r.yaml", "--max_steps", "1"]
    with pytest.raises(ValueError, match="--num_processes needs a value"):
        split_launch_args(["--num_processes", "--max_steps", "1"])


def test_the_repository_configs_are_the_packaged_ones():
    packaged = packaged_accelerate_configs()
    assert {"cpu_ddp", "cpu_zero2", "cpu_zero3", "zero2", "zero3", "multi_gpu", "single_gpu"} <= set(packaged)
    for name, path in packaged.items():
        assert (ROOT / "accelerate_configs" / f"{name}.yaml").read_text() == path.read_text()
        yaml.safe_load(path.read_text())
    assert resolve_accelerate_config(str(packaged["zero3"])) == packaged["zero3"]  # a path works too
    with pytest.raises(ValueError, match="neither a file nor one of the packaged configs"):
        resolve_accelerate_config("zero4")


def test_launch_command_runs_the_packaged_module_in_every_process():
    cmd = launch_command({"--accelerate_config": "zero3", "--num_processes": "8"}, ["--config", "r.yaml"], False)
    assert cmd[1:4] == ["-m", "mempo_trl.commands.launch", "--config_file"]
    assert Path(cmd[4]) == packaged_accelerate_configs()["zero3"]
    assert cmd[5:] == ["--num_processes", "8", "--module", "mempo_trl", "train", "--config", "r.yaml"]
    # --num_processes alone: DDP, on the CPU for a use_cpu recipe.
    assert Path(launch_command({"--num_processes": "2"}, [], True)[4]).name == "cpu_ddp.yaml"
    assert Path(launch_command({"--num_processes": "2"}, [], False)[4]).name == "multi_gpu.yaml"


def test_a_cpu_config_needs_use_cpu():
    check_cpu_config(packaged_accelerate_configs()["cpu_zero3"], use_cpu=True)
    check_cpu_config(packaged_accelerate_configs()["zero3"], use_cpu=False)
    with pytest.raises(ValueError, match="--use_cpu true"):
        check_cpu_config(packaged_accelerate_configs()["cpu_zero3"], use_cpu=False)


def test_a_launch_with_a_bad_input_is_one_error_line_before_any_process_starts(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: false\nbf16: false\nreport_to: none\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mempo_trl",
            "train",
            "--config",
            str(recipe),
            "--accelerate_config",
            "cpu_zero3",
            "--num_processes",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: --accelerate_config cpu_zero3 runs processes on the CPU: add `--use_cpu true` (or `use_cpu: true` in "
        "the recipe)"
    ]
    assert "launching" not in result.stdout


def test_a_deepspeed_config_without_deepspeed_is_one_error_line_naming_the_extra(tmp_path):
    """A newcomer's `.[eval]` install has no DeepSpeed: the README's `cpu_zero3` launch says which extra it needs
    instead of accelerate's traceback from inside the launcher."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nreport_to: none\n")
    argv = ["train", "--config", str(recipe), "--accelerate_config", "cpu_zero3", "--num_processes", "2"]
    code = f"import sys; sys.modules['deepspeed'] = None; from mempo_trl.cli import main; sys.exit(main({argv!r}))"
    result = _run_python(code, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        'error: --accelerate_config cpu_zero3 runs DeepSpeed, which is not installed: `pip install -e ".[deepspeed]"` '
        "(or `pip install mempo_trl[deepspeed]`), or pick `cpu_ddp` / `multi_gpu`"
    ]
    assert "launching" not in result.stdout


def test_a_launch_on_several_machines_is_checked_before_any_process_starts(tmp_path):
    config = packaged_accelerate_configs()["cpu_ddp"]
    check_machines({}, config)  # one machine
    two = {"--num_machines": "2", "--main_process_ip": "10.0.0.1", "--num_processes": "4"}
    check_machines({**two, "--machine_rank": "1"}, config)
    check_machines({"--machine_rank": "1"}, packaged_accelerate_configs()["multi_node"])  # the config's settings
    with pytest.raises(ValueError, match="use a multiple of 2, 2 x the processes of one machine"):
        check_machines({**two, "--num_processes": "3"}, config)
    with pytest.raises(ValueError, match="--num_machines 2 needs --main_process_ip"):
        check_machines({"--num_machines": "2"}, config)
    with pytest.raises(ValueError, match="--num_machines two: expected a whole number"):
        check_machines({"--num_machines": "two"}, config)

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nreport_to: none\n")
    machines = "--accelerate_config cpu_ddp --num_machines 2 --machine_rank 2 --main_process_ip 127.0.0.1"
    command = [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe), *machines.split()]
    result = subprocess.run([*command, "--num_processes", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: --machine_rank 2 with --num_machines 2: give each machine its own rank, 0 to 1 (0 on the main machine)"
    ]
    assert "launching" not in result.stdout and not (tmp_path / "out").exists()


def test_help_is_short_lists_mempo_fields_first_and_imports_neither_torch_nor_transformers(tmp_path):
    """The help is generated from the dataclasses that declare the fields (TRL's `ScriptArguments` too, from TRL,
    which loads it without torch or transformers)."""
    code = (
        "import sys; from mempo_trl.cli import main; rc = main(['train', '--help']); "
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules), rc)"
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.rstrip().endswith("HEAVY [] 0")
    assert len(text.splitlines()) < 120
    assert text.index("--max_turns") < text.index("--dataset_name") < text.index("--corpus")
    assert text.index("--memory_coef") < text.index("  --accelerate_config")
    assert "(default: 8)" in text and text.count("--max_turns") == 1
    homes = (
        (TurnProtocol, "max_turns"),
        (MemoryRewardSettings, "memory_pooling"),
        (DynamicSamplingSettings, "dynamic_sampling"),
        (trl.ScriptArguments, "dataset_config"),
    )
    for source, name in homes:  # where declared
        assert next(f for f in fields(source) if f.name == name).metadata["help"] in text, name
    assert "mempo-trl train --help_all" in text


def test_an_output_dir_with_results_is_refused_before_torch_is_imported(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {out}\n")
    code = (
        "import sys; from mempo_trl.cli import main; "
        f"rc = main(['train', '--config', {str(recipe)!r}]); "
        "print('HEAVY', sorted(m for m in ('torch', 'trl') if m in sys.modules), rc)"
    )
    result = _run_python(code, tmp_path)
    assert result.stdout.rstrip().endswith("HEAVY [] 2"), result.stdout + result.stderr
    assert f"error: output directory {out} holds model.safetensors, which no mempo-trl run recorded" in result.stderr
    # The command line wins over the recipe, as in the full parse: this run gets past the early check.
    fresh = tmp_path / "fresh"
    result = _run_python(
        code.replace("'--config',", f"'--output_dir', {str(fresh)!r}, '--max_steps', 'ten', '--config',"), tmp_path
    )
    assert "error: output directory" not in result.stderr
    assert "invalid int value: 'ten'" in result.stderr


def test_launch_doctests():
    assert doctest.testmod(launch_module, optionflags=doctest.ELLIPSIS).failed == 0


def test_the_lost_exit_barrier_of_a_run_that_ended_well_is_not_logged(monkeypatch):
    """The CI saw it as machine 1's last line after "trained 2 steps; ...": torchrun's agent on machine 1 read the exit
    barrier's answer from the store machine 0 had just closed. A barrier that times out stays in the log."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.agent.server import api

    monkeypatch.setattr(api.logger, "filters", [])
    monkeypatch.setattr(logging.getLogger("torch.distributed.elastic.multiprocessing.api"), "filters", [])
    quiet_launcher_logs()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    monkeypatch.setattr(api.logger, "handlers", [handler])
    for error in (DistNetworkError("Failed to recv, got 0 bytes"), DistStoreError("Socket Timeout")):
        try:
            raise error
        except Exception:
            api.logger.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.2)
    assert [type(record.exc_info[1]) for record in seen] == [DistStoreError]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="open files are read from /proc")
def test_a_build_lock_no_process_holds_is_stale(tmp_path):
    """torch's op build holds its `lock` file open while it builds; one no process holds was left by a build that
    was killed."""
    from mempo_trl.commands.launch import stale_extension_locks

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "build.ninja").touch()  # a finished build: no lock
    code = f"import time; f = open({str(lock)!r}); print('ready', flush=True); time.sleep(60)"
    builder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "ready"
        assert stale_extension_locks(tmp_path) == []  # a build in progress
    finally:
        builder.kill()
        builder.wait()
    assert stale_extension_locks(tmp_path) == [lock]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="open files are read from /proc")
def test_a_deepspeed_launch_refuses_a_stale_build_lock_in_one_line(tmp_path, tiny_model_dir):
    """An op build interrupted once (a timeout, a kill) left its lock: the next DeepSpeed launch would wait on it for
    ever, printing nothing. It stops before any process starts, naming the file and the fix."""
    from helpers import cpu_recipe

    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    recipe = cpu_recipe(tmp_path, tiny_model_dir)
    argv = ["--config", str(recipe), "--accelerate_config", "cpu_zero2", "--num_processes", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "mempo_trl", "train", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {lock} is the lock of a DeepSpeed op build that was interrupted (no process holds it): every "
        f"DeepSpeed launch would wait on it for ever, printing nothing. Remove it (`rm {lock}`) and launch again: "
        "the op is built once more."
    ]
    assert "launching" not in result.stdout and "Traceback" not in result.stderr
