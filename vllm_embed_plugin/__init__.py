"""vllm-embed-plugin: store vLLM's token-embedding table in a compact format.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process,
sometimes more than once: it reads the settings (a bad one stops vLLM here, with one message),
tells vLLM the names of its environment variables, and registers the out-of-tree embedding
layer if there is anything to do. Nothing else.
"""

from __future__ import annotations

import functools
import os

from .log import logger

__version__ = "0.1.0"

_state = {"logged": False, "vllm": None}


def register() -> None:
    from .settings import current_settings

    settings = current_settings()
    _declare_env_names()
    if not _state["logged"]:
        _state["logged"] = True
        logger.info("vllm-embed-plugin %s: %s", __version__, settings.summary())
    if not settings.active:
        return
    if not _vllm_usable(settings.untested_vllm):
        return
    _register_layer()


def _declare_env_names() -> None:
    """vLLM warns "Unknown vLLM environment variable detected" for every VLLM_* variable missing
    from `vllm.envs.environment_variables`, its table of the variables it reads, when it builds
    the engine config (after general plugins load). The plugin's variables go into that table,
    each read from the environment as is, so that the warning no longer reads as "your setting
    is ignored" (vLLM then also hashes them into its compile-cache key and hands them to Ray
    workers, as it does for its own)."""
    from vllm import envs

    from .settings import env_names

    table = getattr(envs, "environment_variables", None)
    if isinstance(table, dict):
        for name in sorted(env_names()):
            table.setdefault(name, functools.partial(os.environ.get, name))


def _vllm_usable(untested_vllm: str) -> bool:
    """Whether this vLLM has what the plugin needs (decided once per process, warned once)."""
    if _state["vllm"] is None:
        from .compat import detect

        support = detect()
        _state["vllm"] = support.acts(untested_vllm)
        if support.status != "supported":
            logger.warning("vllm-embed-plugin %s: %s", __version__, support.describe(untested_vllm))
    return _state["vllm"]


def _register_layer() -> None:
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    from .layer import CompactParallelLMHead, CompactVocabParallelEmbedding

    for name, layer_cls in [
        ("VocabParallelEmbedding", CompactVocabParallelEmbedding),
        ("ParallelLMHead", CompactParallelLMHead),
    ]:
        registered = op_registry_oot.get(name)
        if registered is layer_cls:
            continue  # registered by an earlier call in this process
        if registered is not None:
            logger.warning(
                "vllm-embed-plugin: another plugin already replaces %s (%s); leaving it in place",
                name,
                registered.__qualname__,
            )
            continue
        PluggableLayer.register_oot(layer_cls, name=name)
