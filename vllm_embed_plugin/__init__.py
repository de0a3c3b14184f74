"""vllm-embed-plugin: store vLLM's token-embedding table in a compact format.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process,
sometimes more than once: it reads the settings (a bad one stops vLLM here, with one message),
and registers the out-of-tree embedding layer if there is anything to do. Nothing else.
"""

from __future__ import annotations

from .log import logger


__version__ = "0.1.0"

#: vLLM releases whose layer and quantization APIs this plugin was written against.
SUPPORTED_VLLM = ((0, 26), (0, 32), (0, 33))


_state = {"logged": False}


def register() -> None:
    from .settings import current_settings

    settings = current_settings()
    if not _state["logged"]:
        _state["logged"] = True
        logger.info("vllm-embed-plugin %s: %s", __version__, settings.summary())
    if not settings.active:
        return
    if not _vllm_supported():
        return
    _register_layer()


def _vllm_supported() -> bool:
    import vllm

    release = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if release in SUPPORTED_VLLM:
        return True
    logger.warning(
        "vllm-embed-plugin %s supports vLLM %s, not %s: it stays inactive and changes nothing",
        __version__,
        " and ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM),
        vllm.__version__,
    )
    return False


def _register_layer() -> None:
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    from .layer import CompactVocabParallelEmbedding, TiedCompactLMHead

    for name, layer_cls in [
        ("VocabParallelEmbedding", CompactVocabParallelEmbedding),
        ("ParallelLMHead", TiedCompactLMHead),
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
