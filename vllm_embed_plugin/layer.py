"""The out-of-tree `VocabParallelEmbedding`: decides, per constructed embedding, which model
it belongs to and which format it gets. Everything else is vLLM's own layer.

vLLM builds every `VocabParallelEmbedding(...)` through `PluggableLayer.__new__`, which looks
the class name up in the out-of-tree registry; `ParallelLMHead` has its own name and is
never replaced here.
"""

from __future__ import annotations

import logging

from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from .formats import make_format
from .method import CompactEmbeddingMethod
from .settings import current_settings

logger = logging.getLogger("vllm.embed_plugin")

#: Model tags vLLM sets (`set_model_tag`) while it builds a speculative-decoding drafter.
DRAFT_MODEL_TAGS = ("draft_model", "eagle_head", "medusa_head", "dflash_head", "dspark_head")

_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info("vllm-embed-plugin: %s", message)


class CompactVocabParallelEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding` whose token table may be stored in a compact format."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, **kwargs):
        super().__init__(num_embeddings, embedding_dim, *args, **kwargs)
        method = choose_method(self)
        if method is not None:
            self.quant_method = method
            # vLLM's fused TP lookup reads `weight` as a BF16 table; ours is packed.
            self.use_fused_embedding = False


class TiedCompactLMHead(ParallelLMHead):
    """`ParallelLMHead` that, when tied to a converted embedding, computes its logits from
    the embedding's packed table instead of sharing a BF16 weight. Untied heads and heads
    tied to unconverted embeddings behave exactly as vLLM's."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding):
        method = embed_tokens.quant_method
        if isinstance(method, CompactEmbeddingMethod):
            method.tie_head(self, embed_tokens)
            return self
        return super().tie_weights(embed_tokens)


def choose_method(layer: VocabParallelEmbedding) -> CompactEmbeddingMethod | None:
    """The online method for this embedding, or None to leave it as vLLM built it."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    role, model_config = _owning_model(vllm_config)
    text_config = model_config.hf_text_config
    where = f"{role} {layer.prefix or 'embedding'}"

    if layer.org_vocab_size != getattr(text_config, "vocab_size", None):
        return None  # a position or token-type table, not the token embedding
    decision = current_settings().decide(model_config.model)
    _log_once(f"{role} {decision}")
    if not decision.convert:
        return None
    if not isinstance(layer.quant_method, UnquantizedEmbeddingMethod):
        _log_once(
            f"{where}: left as is, the checkpoint's quantization "
            f"({type(layer.quant_method).__name__}) already covers it"
        )
        return None
    if model_config.word_embeddings_untied_by_checkpoint:
        # vLLM re-ties such a head only to an unconverted table; converting would keep both.
        _log_once(f"{where}: left in BF16, the checkpoint's lm_head may be re-tied to it")
        return None
    fmt = make_format(decision.format, decision.group_size)
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    label = where + (" (tied LM head)" if tied else "")
    return CompactEmbeddingMethod(fmt, label=label, on_error=current_settings().on_error)


def _owning_model(vllm_config):
    """('target' | 'draft', the ModelConfig of the model being built).

    A separate draft model is built with its own model_config; EAGLE and MTP drafters are
    built under the target's model_config, inside a drafter model tag."""
    spec = vllm_config.speculative_config
    draft_config = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft_config is not None:
        from vllm.compilation import backends

        if vllm_config.model_config is draft_config or backends.model_tag in DRAFT_MODEL_TAGS:
            return "draft", draft_config
    return "target", vllm_config.model_config
