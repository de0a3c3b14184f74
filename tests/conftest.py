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
