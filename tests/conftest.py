"""Shared fixtures: the tiny offline model (built once per session) and the shipped demo data."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of the tiny Qwen2 model + tokenizer (`build_tiny_model(seed=0)`); load it with `load_tiny`."""
    from mempo_trl.kit.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory):
    """The tiny model SFT-warm-started on the MemPO format (`build_warm_tiny_model(seed=0)`, ~1-2 min, once)."""
    from mempo_trl.kit.warmstart import build_warm_tiny_model

    return build_warm_tiny_model(tmp_path_factory.mktemp("warm_model"), seed=0)


@pytest.fixture(scope="session")
def demo_paths():
    """`DemoPaths(corpus, train, test)` of the demo set shipped in `mempo_trl/kit/demo/`."""
    from mempo_trl.kit.demo_world import demo_paths

    return demo_paths()
