"""The plugin's logger: a child of vLLM's, so it shares vLLM's handler, format and level."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.embed_plugin")

_said: set[str] = set()


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log a message once per process (vLLM builds and loads in several processes)."""
    if message not in _said:
        _said.add(message)
        logger.log(level, "vllm-embed-plugin: %s", message)
