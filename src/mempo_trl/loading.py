"""Loading a policy's tokenizer exactly as it was trained; checking a model path and its files before anything is
loaded, and the Hub before a run that pushes to it."""

import json
import os
from pathlib import Path


MODEL_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")
"""The JSON files of a saved model that loading needs; each must hold a JSON object."""
TOKENIZER_VOCABULARIES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
"""Files that hold a tokenizer's vocabulary: a model directory needs one of them."""
RESTORE = "restore it from the saved model, or save the model again"


def check_model_path(path: str) -> None:
    """Raise `FileNotFoundError` with a fix when `path` names a local model that is not there or not a model.

    A Hub id (`name` or `org/name`, not an existing path) passes unless `HF_HUB_OFFLINE` is set and it is not in the
    local cache. The files of a local directory are checked too (`check_model_files`); a LoRA adapter directory is
    refused with the `mempo-trl merge-lora` command that makes it a model.

    Example:
        >>> check_model_path("./no/such/model")
        Traceback (most recent call last):
        FileNotFoundError: model path ./no/such/model does not exist. Pass a directory written by save_pretrained ...
    """
    local, fix = Path(path).expanduser(), "Pass a directory written by save_pretrained or a Hub id such as org/name."
    if local.is_file():
        raise FileNotFoundError(f"model path {path} is a file, not a model directory. {fix}")
    if local.is_dir():
        from mempo_trl.checkpoints import check_final_save

        check_final_save(local)
        if not (local / "config.json").is_file() and (local / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"model path {path} is a LoRA adapter, not a model: merge it with `mempo-trl merge-lora "
                f"--model_name_or_path {path} --output_dir {path.rstrip('/')}-merged` and pass the merged directory."
            )
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"model path {path} is not a model directory (no config.json). {fix}")
        check_model_files(local)
        return
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path:
        raise FileNotFoundError(f"model path {path} does not exist. {fix}")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(path, "config.json")
        except ValueError:  # not a valid repo id either
            cached = None
        if not isinstance(cached, str):
            raise FileNotFoundError(
                f"model {path!r} is neither a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is "
                f"set. {fix}"
            )


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_model_files(directory: str | Path) -> None:
    """Raise `ValueError` naming the file when a local model directory cannot be loaded as saved.

    Checks, without loading any weights: every JSON file (`MODEL_JSON_FILES`) holds a JSON object; a tokenizer
    vocabulary is there (`TOKENIZER_VOCABULARIES`) and ``tokenizer.json`` parses; ``config.json`` describes a model
    transformers can build (valid fields, a known ``dtype``); each safetensors weight file is whole and its tensors
    have the shapes that ``config.json`` gives them (an edited ``vocab_size`` or ``hidden_size``).

    Example:
        >>> check_model_files("outputs/damaged")  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: outputs/damaged/config.json does not match the weights in model.safetensors: ...
    """
    directory = Path(directory)
    for name in MODEL_JSON_FILES:
        file = directory / name
        if not file.is_file():
            continue
        read_json_object(file)
    if not any((directory / name).is_file() for name in TOKENIZER_VOCABULARIES):
        raise ValueError(
            f"{directory / 'tokenizer.json'} is missing: {directory} holds no tokenizer; copy the tokenizer files of "
            "the model it was trained from (save_pretrained writes them)"
        )
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as err:  # `tokenizers` raises plain Exceptions for files it cannot parse
            raise ValueError(
                f"{directory / 'tokenizer.json'} is not a tokenizer ({_one_line(err)}); {RESTORE}"
            ) from None
    _check_config_and_weights(directory)


def read_json_object(file: Path) -> dict:
    """The JSON object in ``file``; `ValueError` naming the file when it is not valid JSON or not an object."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:  # JSON and encoding errors
        raise ValueError(f"{file} is not valid JSON ({_one_line(err)}); {RESTORE}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds {type(value).__name__}, not a JSON object; {RESTORE}")
    return value


def check_adapter_files(directory: str | Path) -> None:
    """Raise `ValueError` (or `CheckpointError`) naming the file when a LoRA adapter directory cannot be merged or
    loaded as saved: a final save cut short (`check_final_save`), an ``adapter_config.json`` that is not a JSON
    object, adapter weights that are missing or not whole (the checks a resumed checkpoint gets).

    Example:
        >>> check_adapter_files("outputs/lora-cut")  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: outputs/lora-cut/adapter_model.safetensors is truncated (1000 of 9816 bytes): the adapter is ...
    """
    from mempo_trl.checkpoints import (
        CheckpointError,
        check_final_save,
        check_safetensors,
        check_torch_file,
        newest_complete_checkpoint,
    )

    directory = Path(directory)
    check_final_save(directory)
    config = directory / "adapter_config.json"
    read_json_object(config)
    newest = newest_complete_checkpoint(directory)
    fix = f"restore it, or merge the newest complete checkpoint, {newest}, instead" if newest else RESTORE
    weights = [directory / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (directory / n).is_file()]
    if not weights:
        raise ValueError(
            f"{directory / 'adapter_model.safetensors'} is missing: {directory} holds no adapter weights; {fix}"
        )
    try:
        check_safetensors(weights[0]) if weights[0].suffix == ".safetensors" else check_torch_file(weights[0])
    except (CheckpointError, OSError) as err:
        raise ValueError(f"{_one_line(err)}: the adapter is damaged; {fix}") from None


def _check_config_and_weights(directory: Path) -> None:
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    from mempo_trl.checkpoints import CheckpointError, check_safetensors

    config_file = directory / "config.json"
    for key, dtype in json.loads(config_file.read_text(encoding="utf-8")).items():
        if key in ("dtype", "torch_dtype") and isinstance(dtype, str) and dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(
                    f"{config_file}: {key} {dtype!r} is not a torch dtype (float32, bfloat16, ...); {RESTORE}"
                )
    try:
        config = AutoConfig.from_pretrained(str(directory))
        if getattr(config, "quantization_config", None):
            return  # pre-quantized weights are packed: their shapes are not the config's
        expected = {}
        if not is_deepspeed_zero3_enabled():  # ZeRO-3 partitions what it builds (the launcher checked it first)
            with torch.device("meta"):
                expected = {
                    key: tuple(t.shape) for key, t in AutoModelForCausalLM.from_config(config).state_dict().items()
                }
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, StrictDataclassError) as err:
        raise ValueError(
            f"{config_file} does not describe a model that can be built ({_one_line(err)}); {RESTORE}"
        ) from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object; {RESTORE}")
        weight_files = [directory / shard for shard in sorted(set(map(str, weight_map.values())))]
    else:
        weight_files = [directory / "model.safetensors"] if (directory / "model.safetensors").is_file() else []
    for weights in weight_files:
        try:
            header = check_safetensors(weights)
        except (CheckpointError, OSError) as err:
            raise ValueError(f"{_one_line(err)}: the weights are damaged; {RESTORE}") from None
        for key, tensor in header.items():
            if key in expected and isinstance(tensor, dict) and tuple(tensor.get("shape", ())) != expected[key]:
                raise ValueError(
                    f"{config_file} does not match the weights in {weights.name}: {key} has shape "
                    f"{tuple(tensor['shape'])} there, {expected[key]} by the config (an edited size such as vocab_size "
                    f"or hidden_size?); {RESTORE}"
                )


def load_tokenizer(path: str | Path, revision: str | None = None):
    """The tokenizer of a model directory or Hub id, its chat template checked (`check_chat_template`).

    A directory with a ``tokenizer.json`` is loaded as a `PreTrainedTokenizerFast`, exactly as that file says:
    `AutoTokenizer` swaps in `Qwen2Tokenizer` for ``model_type: qwen2`` configs, which re-tokenizes a custom
    ``tokenizer.json`` differently. Anything else goes through `AutoTokenizer`.

    Example:
        >>> load_tokenizer("outputs/my-agent").eos_token  # doctest: +SKIP
        '<|im_end|>'
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if Path(path, "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), revision=revision)
    if tokenizer.chat_template:
        check_chat_template(tokenizer, path)
    return tokenizer


def check_chat_template(tokenizer, path: str | Path) -> None:
    """Raise `ValueError` naming the template's file when the chat template cannot render a MemPO round (system,
    user, assistant, tool and the generation prompt): a syntax error, or a `raise_exception` it reaches."""
    import jinja2

    from mempo_trl.context import initial_messages, round_messages

    messages = round_messages(initial_messages("q"), [("<mem>m</mem>", "<information>i</information>")])
    try:
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as err:
        local = Path(path, "chat_template.jinja")
        where = local if local.is_file() else Path(path, "tokenizer_config.json") if Path(path).is_dir() else path
        raise ValueError(
            f"the chat template in {where} cannot render a MemPO round ({type(err).__name__}: {_one_line(err)}); "
            f"{RESTORE}"
        ) from None


def check_hub_reachable(why: str = "push_to_hub") -> None:
    """Raise `ConnectionError` (one line, naming the endpoint) unless the Hugging Face Hub answers: before the work
    whose results `why` would upload, not after. The endpoint is huggingface_hub's (`HF_ENDPOINT`); nothing is sent
    but one HEAD request, and `HF_HUB_OFFLINE` fails at once.

    Example:
        >>> check_hub_reachable()  # doctest: +SKIP
        Traceback (most recent call last):
        ConnectionError: push_to_hub needs the Hugging Face Hub, but http://127.0.0.1:9 cannot be reached ...
    """
    import httpx
    from huggingface_hub import constants

    fix = f"check the network and HF_ENDPOINT, or set {why}: false and upload the output directory later"
    if constants.HF_HUB_OFFLINE:
        raise ConnectionError(f"{why} needs the Hugging Face Hub, but HF_HUB_OFFLINE is set; {fix}")
    try:
        httpx.head(constants.ENDPOINT, timeout=15)
    except httpx.HTTPError as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConnectionError(
            f"{why} needs the Hugging Face Hub, but {constants.ENDPOINT} cannot be reached ({reason}); {fix}"
        ) from None


def vllm_server_url(host: str, port: int, base_url: str | None = None) -> str:
    """The URL TRL's vLLM client talks to: ``base_url`` when given, else ``http://host:port``.

    Example:
        >>> vllm_server_url("10.0.0.5", 8000), vllm_server_url("h", 1, "https://vllm.example/v0/")
        ('http://10.0.0.5:8000', 'https://vllm.example/v0')
    """
    return base_url.rstrip("/") if base_url else f"http://{host}:{port}"


def check_vllm_server(url: str, timeout: float, interval: float = 2.0) -> None:
    """Raise `ConnectionError` (one line, naming ``url``) unless ``url/health`` answers 200 within ``timeout``
    seconds (TRL's ``vllm_server_timeout``), polled every ``interval`` seconds: before the model loads, as TRL's
    client then waits for the same endpoint (vLLM answers ``/health/`` with a redirect). A server started alongside
    the training job has that long to come up.

    Example:
        >>> check_vllm_server("http://127.0.0.1:9", timeout=0.1)  # doctest: +SKIP
        Traceback (most recent call last):
        ConnectionError: the vLLM server http://127.0.0.1:9 did not answer /health within 0 s (...) ...
    """
    import time

    import httpx

    deadline, reason = time.monotonic() + timeout, "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            answer = httpx.get(f"{url}/health", timeout=max(0.1, min(5.0, left)))
            if answer.status_code == 200:
                return
            reason = f"HTTP {answer.status_code}"
        except httpx.HTTPError as err:
            reason = " ".join(str(err).split()) or type(err).__name__
        if time.monotonic() + interval > deadline:
            break
        time.sleep(interval)
    raise ConnectionError(
        f"the vLLM server {url} did not answer /health within {timeout:g} s ({reason}): start it first "
        "(`trl vllm-serve --model MODEL --host 0.0.0.0 --port PORT` on its node), point vllm_server_host / "
        "vllm_server_port (or vllm_server_base_url) at it, or wait longer with vllm_server_timeout."
    )


def trainer_group_address() -> str:
    """The address TRL's vLLM client announces for the weight-sync group, as vLLM's ``get_ip`` finds it:
    ``VLLM_HOST_IP``, else the address of this machine's default route (no packet is sent), else ``0.0.0.0``."""
    import socket

    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("8.8.8.8", 80))
            return probe.getsockname()[0]
    except OSError:
        return "0.0.0.0"


def check_vllm_group_port(server_host: str, port: int, timeout: float = 5.0) -> None:
    """Raise `ConnectionError` (one line naming host and port) when TRL's weight-sync group cannot form at
    ``port`` (``vllm_group_port``), before the model loads rather than when the first step syncs.

    With vLLM >= 0.28 the trainer's main process is rank 0 of that group: it listens on ``port`` at
    `trainer_group_address`, and the server's workers connect to it (the server listens on no group port). So the
    port must be free here (a TCP connect within ``timeout`` seconds that succeeds means another process, an earlier
    run's trainer say, holds it), and the announced address must not be one the server on ``server_host`` cannot
    reach back (a loopback or unset address when the server is on another machine).

    Example:
        >>> check_vllm_group_port("10.0.0.5", 51216)  # doctest: +SKIP
        Traceback (most recent call last):
        ConnectionError: the weight-sync group port 10.0.0.7:51216 (vllm_group_port) is in use on this machine ...
    """
    import socket

    address = trainer_group_address()
    if _loopback(address) and not _loopback(server_host):
        raise ConnectionError(
            f"the vLLM server on {server_host} would connect back to {address}:{port} (vllm_group_port) for the "
            "weight sync, an address of no other machine: set VLLM_HOST_IP to this machine's address that the server "
            "node reaches."
        )
    for target in dict.fromkeys(("127.0.0.1" if address == "0.0.0.0" else address, "127.0.0.1")):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout)
            held = probe.connect_ex((target, port)) == 0
        if held:
            raise ConnectionError(
                f"the weight-sync group port {target}:{port} (vllm_group_port) is in use on this machine: the trainer "
                "listens there for the vLLM server's workers. End the process that holds it (an earlier run's "
                "trainer?), or pick a free port with vllm_group_port."
            )


def check_vllm_weight_sync_device(use_cpu: bool) -> None:
    """Raise `ValueError` unless this trainer has a CUDA device for the server's weight sync: TRL's client sends the
    weights over vLLM's NCCL weight-transfer engine (`VLLMClient.init_communicator`), which refuses any other device
    once the model has loaded."""
    import torch

    if use_cpu or not torch.cuda.is_available():
        raise ValueError(
            "vllm_mode: server syncs the weights into the vLLM server over NCCL, which needs a CUDA device on the "
            f"trainer, and this run has none ({'use_cpu is set' if use_cpu else 'torch sees no CUDA device'}): train "
            "on a GPU node, or set vllm_mode: colocate (vLLM in the training process; it runs on a CPU too)."
        )


def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (a loopback or unset address); a name that does not resolve is not."""
    import ipaddress
    import socket

    if host in ("localhost", "0.0.0.0", ""):
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
