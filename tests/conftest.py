import os

import pytest


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """Each test starts with no VLLM_EMBED_* settings and fresh cached settings."""
    for key in list(os.environ):
        if key.startswith("VLLM_EMBED_") and key != "VLLM_EMBED_CACHE":
            monkeypatch.delenv(key)
    from vllm_embed_plugin.settings import current_settings

    current_settings.cache_clear()
    yield
    current_settings.cache_clear()


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine the GPU tests run the same Triton kernels compiled, so the interpreter
    lane (for machines without a GPU) is skipped there; the interpreter of older Triton
    releases also fails under NumPy 2.5 (its program ids are 1-element arrays)."""
    import torch

    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA present: the GPU tests run these kernels compiled")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)
