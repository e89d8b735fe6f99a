"""The packaged launch path of `mempo-trl train`, in the style of TRL's CLI (`trl grpo --accelerate_config zero3`).

    mempo-trl train --config recipe.yaml --accelerate_config zero3 --num_processes 8
    mempo-trl train --config examples/configs/tiny_cpu.yaml --accelerate_config cpu_ddp --num_processes 2

`--accelerate_config` names a config shipped in `mempo_trl/accelerate_configs/` (`cpu_ddp`, `cpu_zero2`,
`cpu_zero3`, `single_gpu`, `multi_gpu`, `zero2`, `zero3`, `zero3_offload`, `multi_node`) or a YAML path;
`--num_processes` alone picks `cpu_ddp` for a `use_cpu` recipe and `multi_gpu` otherwise. The recipe and the output
directory are checked in this process first (a bad input ends in one `error:` line, exit 2, before any process
starts); then `accelerate launch` runs `python -m mempo_trl train` in each process with the remaining arguments.

Stop signals reach every process and end the run as a single process ends it: SIGTERM, SIGINT or SIGHUP to
`mempo-trl train` is forwarded to the launcher, which forwards it to the processes it started (`run_launcher`, the
launcher run as ``python -m mempo_trl.commands.launch``); they save a checkpoint and exit 2, rank 0 having printed
the one `error:` line that names it, and `mempo-trl train` exits 2 once they have. A run whose processes end in
`error:` lines (exit 2) exits 2 without the launcher's `ChildFailedError` report; any other failure keeps it.
"""

import contextlib
import os
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path


LAUNCH_FLAGS = (
    "--accelerate_config",
    "--num_processes",
    "--num_machines",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
)
"""`accelerate launch` options `mempo-trl train` accepts (each takes one value); the rest go to the training."""


def packaged_accelerate_configs() -> dict[str, Path]:
    """The accelerate configs shipped with the package, by name (file name without `.yaml`)."""
    root = resources.files("mempo_trl") / "accelerate_configs"
    return {Path(entry.name).stem: Path(str(entry)) for entry in root.iterdir() if entry.name.endswith(".yaml")}


def split_launch_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(`LAUNCH_FLAGS` given, with their values; the other arguments, in order). Accepts `--flag value` and
    `--flag=value`.

    Example:
        >>> split_launch_args(["--config", "r.yaml", "--num_processes=2", "--accelerate_config", "zero3"])
        ({'--num_processes': '2', '--accelerate_config': 'zero3'}, ['--config', 'r.yaml'])
    """
    launch: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in LAUNCH_FLAGS:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ValueError(f"{flag} needs a value (see `mempo-trl train --help`)")
                i += 1
                value = argv[i]
            launch[flag] = value
        else:
            rest.append(argv[i])
        i += 1
    return launch, rest


def resolve_accelerate_config(name: str) -> Path:
    """A packaged config by name, or a YAML file by path.

    Example:
        >>> resolve_accelerate_config("cpu_zero3").name
        'cpu_zero3.yaml'
    """
    configs = packaged_accelerate_configs()
    if name in configs:
        return configs[name]
    if Path(name).is_file():
        return Path(name)
    raise ValueError(
        f"--accelerate_config {name}: neither a file nor one of the packaged configs ({', '.join(sorted(configs))})"
    )


def launch_command(launch: dict[str, str], train_argv: list[str], use_cpu: bool) -> list[str]:
    """The `accelerate launch` command (through `run_launcher`) that runs `python -m mempo_trl train train_argv` in
    every process.

    Example:
        >>> cmd = launch_command({"--num_processes": "2"}, ["--config", "r.yaml"], use_cpu=True)
        >>> [Path(cmd[4]).name, *cmd[5:]]
        ['cpu_ddp.yaml', '--num_processes', '2', '--module', 'mempo_trl', 'train', '--config', 'r.yaml']
    """
    launch = dict(launch)
    config = launch.pop("--accelerate_config", "cpu_ddp" if use_cpu else "multi_gpu")
    options = [item for flag, value in launch.items() for item in (flag, value)]
    return [
        sys.executable,
        "-m",
        "mempo_trl.commands.launch",
        "--config_file",
        str(resolve_accelerate_config(config)),
        *options,
        "--module",
        "mempo_trl",
        "train",
        *train_argv,
    ]


def check_cpu_config(config: Path, use_cpu: bool) -> None:
    """A `cpu_*` config needs `use_cpu: true` in the recipe (else each process trains its own copy, or DeepSpeed
    fails its batch check)."""
    if Path(config).name.startswith("cpu_") and not use_cpu:
        raise ValueError(
            f"--accelerate_config {Path(config).stem} runs processes on the CPU: add `--use_cpu true` "
            "(or `use_cpu: true` in the recipe)"
        )


def check_deepspeed_installed(config: Path) -> None:
    """A config with `distributed_type: DEEPSPEED` needs the `deepspeed` package: say so before anything starts
    (accelerate would raise from inside the launcher)."""
    import importlib.util

    import yaml

    settings = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    uses_deepspeed = isinstance(settings, dict) and settings.get("distributed_type") == "DEEPSPEED"
    if uses_deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise ValueError(
            f"--accelerate_config {Path(config).stem} runs DeepSpeed, which is not installed: "
            '`pip install -e ".[deepspeed]"` (or `pip install mempo_trl[deepspeed]`), or pick `cpu_ddp` / `multi_gpu`'
        )


def stale_extension_locks(root: Path) -> list[Path]:
    """The `lock` files of torch's extension builds under ``root`` (``$TORCH_EXTENSIONS_DIR``: ``root/NAME/lock``,
    or torch's default root: ``root/py311_cpu/NAME/lock``) that no process on this machine holds open (Linux's /proc;
    elsewhere none is reported). torch creates one while it builds an op and removes it after: a build that was
    killed leaves it, and every later build of that op waits on it for ever."""
    locks = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):  # a process that ended, or one of another user
            held |= {os.path.realpath(fd) for fd in fd_dir.iterdir()}
    return [lock for lock in locks if os.path.realpath(lock) not in held]


def check_extension_locks(config: Path) -> None:
    """A DeepSpeed config builds its ops with torch's extension builder: refuse a stale lock of that build
    (`stale_extension_locks`), which would hold every process at its first op, silently, for ever."""
    import yaml

    settings = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    if not (isinstance(settings, dict) and settings.get("distributed_type") == "DEEPSPEED"):
        return
    from torch.utils.cpp_extension import get_default_build_root

    stale = stale_extension_locks(Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()))
    if stale:
        raise ValueError(
            f"{stale[0]} is the lock of a DeepSpeed op build that was interrupted (no process holds it"
            f"{f'; {len(stale) - 1} more like it' if len(stale) > 1 else ''}): every DeepSpeed launch would wait on "
            f"it for ever, printing nothing. Remove it (`rm {' '.join(str(lock) for lock in stale)}`) and launch "
            "again: the op is built once more."
        )


def launch_setting(launch: dict[str, str], config: Path, name: str, default=None):
    """An `accelerate launch` setting: `--name` given, else the accelerate config's `name`, else ``default``."""
    import yaml

    if f"--{name}" in launch:
        return launch[f"--{name}"]
    settings = yaml.safe_load(config.read_text(encoding="utf-8"))
    return settings.get(name, default) if isinstance(settings, dict) else default


def machine_rank(launch: dict[str, str], config: Path) -> int:
    """This machine's rank: `--machine_rank`, else the accelerate config's `machine_rank`, else 0.

    Example:
        >>> machine_rank({"--machine_rank": "1"}, resolve_accelerate_config("multi_node"))
        1
    """
    return int(launch_setting(launch, config, "machine_rank", 0))


def check_machines(launch: dict[str, str], config: Path) -> None:
    """With several machines (`num_machines` > 1): `machine_rank` is one of them, `main_process_ip` is set, and
    `num_processes` (the processes of all machines together, as in accelerate) is a multiple of `num_machines` (else
    accelerate starts fewer processes than asked, silently).

    Example:
        >>> check_machines({"--num_machines": "2", "--num_processes": "3"}, resolve_accelerate_config("multi_node"))
        Traceback (most recent call last):
        ValueError: --num_processes 3 is the number of processes on all 2 machines together ...
    """
    values = {name: launch_setting(launch, config, name) for name in ("num_machines", "num_processes", "machine_rank")}
    for name, value in values.items():
        if value is not None and not str(value).isdigit():
            raise ValueError(f"--{name} {value}: expected a whole number")
    machines = int(values["num_machines"] or 1)
    if machines <= 1:
        return
    rank, processes = int(values["machine_rank"] or 0), int(values["num_processes"] or machines)
    if rank >= machines:
        raise ValueError(
            f"--machine_rank {rank} with --num_machines {machines}: give each machine its own rank, 0 to {machines - 1} "
            "(0 on the main machine)"
        )
    if processes % machines:
        raise ValueError(
            f"--num_processes {processes} is the number of processes on all {machines} machines together (as in "
            f"accelerate): use a multiple of {machines}, {machines} x the processes of one machine"
        )
    if not launch_setting(launch, config, "main_process_ip"):
        raise ValueError(
            f"--num_machines {machines} needs --main_process_ip: an address of the main machine (machine_rank 0) "
            "that every machine reaches"
        )


@contextlib.contextmanager
def forwarded_stop_signals(targets):
    """Within, each stop signal this process receives (`mempo_trl.interruptions.STOP_SIGNALS`) is sent on to the
    processes ``targets()`` returns (objects with ``send_signal``), and this process goes on waiting for them. Main
    thread only; elsewhere signals keep their meaning."""
    import threading

    from mempo_trl.interruptions import STOP_SIGNALS

    def forward(signum, frame):
        for process in targets():
            with contextlib.suppress(OSError):  # it has just ended
                process.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def reported_by_ranks(exitcodes: list[int]) -> bool:
    """Whether the failed processes of a run (their exit codes) ended as `mempo-trl` reports an error: at least one
    exited 2 (after its `error:` line), and the others too, or were ended by the launcher's stop signal once it had.

    Example:
        >>> reported_by_ranks([2, 2]), reported_by_ranks([2, -15]), reported_by_ranks([1, 2]), reported_by_ranks([-9])
        (True, True, False, False)
    """
    from mempo_trl.commands import USAGE_EXIT
    from mempo_trl.interruptions import STOP_SIGNALS

    stopped = {-int(signum) for signum in STOP_SIGNALS}
    return USAGE_EXIT in exitcodes and all(code == USAGE_EXIT or code in stopped for code in exitcodes)


def lost_exit_barrier(record) -> bool:
    """Whether a log record is torchrun's agent saying its exit barrier lost the store (`DistNetworkError`): the
    barrier every machine's agent passes once all of its processes have ended well, where the agent of the main
    machine, which serves the store, may leave and close it before another machine's agent reads its answer. Nothing
    is lost then: every process of this machine had finished; a barrier that times out (a machine never came) is a
    `DistStoreError` and stays reported.

    Example:
        >>> import logging, sys
        >>> from torch.distributed import DistNetworkError, DistStoreError
        >>> def record(error):
        ...     try:
        ...         raise error
        ...     except Exception:
        ...         return logging.LogRecord("a", 40, "", 0, "Error waiting on exit barrier. Elapsed: 0.1 seconds",
        ...                                  (), sys.exc_info())
        >>> lost_exit_barrier(record(DistNetworkError("Failed to recv"))), lost_exit_barrier(record(DistStoreError("")))
        (True, False)
    """
    from torch.distributed import DistNetworkError

    return (
        record.getMessage().startswith("Error waiting on exit barrier")
        and record.exc_info is not None
        and isinstance(record.exc_info[1], DistNetworkError)
    )


def quiet_launcher_logs() -> None:
    """Leave out of torchrun's logs what a run's own lines already say: a process's failure with exit code 2 (it
    printed its `error:` line) and the agent's `lost_exit_barrier` record (the run ended well)."""
    import logging

    from mempo_trl.commands import USAGE_EXIT

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith(f"failed (exitcode: {USAGE_EXIT})")
    )
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: not lost_exit_barrier(record)
    )


def run_launcher(argv: list[str]) -> int:
    """`accelerate launch argv`, run in this process with stop signals forwarded to the processes it starts (and not
    handled by torchrun's agent, which would end them after 30 s, mid-save). A run whose processes end as
    `reported_by_ranks` exits 2 quietly: they printed the `error:` line (rank 0 only, for a stop). Anything else keeps
    the launcher's report (`quiet_launcher_logs`)."""
    import psutil
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from mempo_trl.commands import USAGE_EXIT
    from mempo_trl.processes import PARENT_PID_ENV, end_with_parent

    end_with_parent()  # `mempo-trl train` killed: SIGTERM, forwarded below
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the processes it starts end with it
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGQUIT"  # torchrun's `--signals_to_handle`: the stop signals are ours
    quiet_launcher_logs()
    args = launch_command_parser().parse_args(argv)
    with forwarded_stop_signals(psutil.Process().children):
        try:
            launch_command(args)
        except ChildFailedError as err:
            if not reported_by_ranks([failure.exitcode for failure in err.failures.values()]):
                raise
            return USAGE_EXIT
        except subprocess.CalledProcessError as err:  # a single process, started by accelerate's simple launcher
            if err.returncode != USAGE_EXIT:
                raise
            return USAGE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(run_launcher(sys.argv[1:]))
