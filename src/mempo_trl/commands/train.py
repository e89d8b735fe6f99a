"""`mempo-trl train`: train a MemPO search agent from a YAML recipe (`mempo_trl.commands.recipe`).

    mempo-trl train --config examples/configs/qwen2.5-3b-lora.yaml --accelerate_config zero2 --num_processes 8
    accelerate launch --config_file accelerate_configs/zero2.yaml -m mempo_trl train \\
        --config examples/configs/qwen2.5-3b-lora.yaml

The first starts the processes itself (`mempo_trl.commands.launch`); `--help` is short and imports neither torch nor
TRL (`mempo_trl.commands.train_help`; `--help_all` lists every field). A recipe that would overwrite results is
refused in a second, before torch and TRL load; any other bad input ends in one `error:` line before training.
"""

import argparse
import os
import subprocess
from pathlib import Path

from mempo_trl.commands import (
    INPUT_FIELDS,
    CommandError,
    add_command,
    flag_value,
    one_line_errors,
    quiet_upstream_noise,
    refuse_yaml_aliases,
    run,
)


def parse_args(argv: list[str] | None = None):
    """(script_args, training_args, model_args, retriever_args) of the recipe (`--config` and the command line);
    a bad argument raises `CommandError` (one `error:` line)."""
    from mempo_trl.commands.recipe import make_parser

    prog = "mempo-trl train"
    parser = one_line_errors(make_parser(prog), prog)
    *parsed, unknown = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    if unknown:
        raise CommandError(f"unrecognized arguments: {' '.join(unknown)} (see `{prog} --help`)")
    return tuple(parsed)


def check_output_dir_early(argv: list[str]) -> int:
    """Refuse a recipe with YAML aliases, and an `output_dir` that already holds results, in a second, before torch
    and TRL are imported.

    Reads `output_dir`, `overwrite_output_dir`, `resume_from_checkpoint` and the inputs (`INPUT_FIELDS`) from the
    recipe and the command line the way the full parse will (command line wins); anything it cannot read is left to
    that parse.
    """
    import yaml

    from mempo_trl.outputs import prepare_output_dir

    refuse_yaml_aliases(argv)
    settings = {}
    config = flag_value(argv, "config")
    if config and Path(config).is_file():
        try:
            loaded = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
        except yaml.YAMLError:
            loaded = None
        settings = loaded if isinstance(loaded, dict) else {}
    for name in ("output_dir", "overwrite_output_dir", "resume_from_checkpoint", *INPUT_FIELDS):
        value = flag_value(argv, name)
        if value is not None:
            settings[name] = value
    output_dir = settings.get("output_dir")
    if not isinstance(output_dir, str) or not Path(output_dir).is_dir() or int(os.environ.get("RANK", "0")) != 0:
        return 0  # nothing to refuse yet (and nothing is created before the full parse)
    overwrite = str(settings.get("overwrite_output_dir", False)).lower() in ("true", "1", "yes")
    resume = settings.get("resume_from_checkpoint")
    inputs = {what: settings[name] for name, what in INPUT_FIELDS.items() if isinstance(settings.get(name), str)}
    prepare_output_dir(output_dir, overwrite, str(resume) if resume else None, inputs={**inputs, "recipe": config})
    return 0


def _train(argv: list[str]) -> int:
    """`recipe.main`; a stopped run's line (which names the checkpoint every process saved) is left to the first
    process of each machine (`LOCAL_RANK` 0): one line per machine."""
    from mempo_trl.commands import USAGE_EXIT, recipe
    from mempo_trl.interruptions import TrainingStopped

    try:
        return recipe.main(*parse_args(argv))
    except TrainingStopped:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 or os.environ.get("MEMPO_DEBUG"):
            raise
        return USAGE_EXIT


def launch_training(argv: list[str]) -> int:
    """Check the recipe and the output directory here, then start the processes; returns the launcher's exit code.
    A launcher killed by a signal leaves its processes to this one (`adopt_orphans`): they stop as on SIGTERM, and
    once they have ended this one exits 2 if they reported it (`reported_by_ranks`), else 128 + the signal."""
    import psutil

    from mempo_trl.commands import USAGE_EXIT
    from mempo_trl.commands.launch import (
        check_cpu_config,
        check_deepspeed_installed,
        check_extension_locks,
        check_machines,
        forwarded_stop_signals,
        launch_command,
        machine_rank,
        reported_by_ranks,
        split_launch_args,
    )
    from mempo_trl.commands.recipe import check_before_training
    from mempo_trl.processes import adopt_orphans, child_env, wait_adopted

    launch, train_argv = split_launch_args(argv)
    script_args, training_args, model_args, retriever_args = parse_args(train_argv)
    cmd = launch_command(launch, train_argv, use_cpu=training_args.use_cpu)
    check_cpu_config(Path(cmd[4]), training_args.use_cpu)
    check_deepspeed_installed(Path(cmd[4]))
    check_machines(launch, Path(cmd[4]))
    main_machine = machine_rank(launch, Path(cmd[4])) == 0  # the others' first process is not the run's first
    check_before_training(script_args, training_args, model_args, retriever_args, first=main_machine)
    check_extension_locks(Path(cmd[4]))
    # torchrun sets OMP_NUM_THREADS=1 in every process anyway (and warns that it did); say it once here instead.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if Path(cmd[4]).name.startswith("cpu_"):  # DeepSpeed's accelerator, named: no "Setting accelerator to CPU" warning
        env.setdefault("DS_ACCELERATOR", "cpu")
    print(f"mempo-trl: launching {' '.join(cmd[3:])}", flush=True)
    adopt_orphans()  # a killed launcher's processes become this one's: their exit codes make this one's
    process = subprocess.Popen(cmd, env=child_env(env))
    with forwarded_stop_signals(lambda: [process] if process.returncode is None else psutil.Process().children()):
        rc = process.wait()
        if rc >= 0:
            return rc
        # The launcher was killed (SIGKILL: it forwarded nothing); its processes received the parent-death signal.
        codes = [code for code in wait_adopted() if code]
        return USAGE_EXIT if reported_by_ranks(codes) else 128 - rc


def leave_launched_process(rc: int) -> None:
    """End a process started by a launcher (`WORLD_SIZE` > 1) without interpreter finalisation.

    Even after `release_process_groups`, gloo's threads can abort a finished rank while Python tears down
    ("terminate called without an active exception", pytorch/pytorch#190489; seen in CI after ZeRO-3 runs), and the
    launcher then reports the whole run as failed. Everything is saved by now: run the `atexit` handlers (loggers
    flush there), flush the streams and exit with ``rc``.
    """
    import atexit
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    """Entry point: a bad recipe, path or data stops before training with one `error:` line (exit 2).

    With `--accelerate_config` / `--num_processes` (and not yet launched) it starts the processes itself
    (`mempo_trl.commands.launch`)."""
    import sys

    from mempo_trl.commands.launch import LAUNCH_FLAGS
    from mempo_trl.processes import end_with_parent

    end_with_parent()  # a launched process: its launcher killed, SIGTERM (a checkpoint once training runs)
    quiet_upstream_noise()  # under a launcher, `-m mempo_trl train` comes here without `mempo_trl.cli.main`
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        from mempo_trl.commands.train_help import short_help

        print(short_help())
        return 0
    argv = ["--help" if arg == "--help_all" else arg for arg in argv]
    rc = run(check_output_dir_early, argv)
    if rc:
        return rc
    if "WORLD_SIZE" not in os.environ and any(arg.split("=")[0] in LAUNCH_FLAGS for arg in argv):
        return run(launch_training, argv)
    rc = run(_train, argv)
    leave_launched_process(rc)
    return rc


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "train", "Train a MemPO agent (TRL-style arguments; --config recipe.yaml).", main)
