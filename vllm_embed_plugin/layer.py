"""The out-of-tree `VocabParallelEmbedding`: decides, per constructed embedding, which model
it belongs to and which format it gets. Everything else is vLLM's own layer.

vLLM builds every `VocabParallelEmbedding(...)` through `PluggableLayer.__new__`, which looks
the class name up in the out-of-tree registry. `ParallelLMHead` is registered too
(`CompactParallelLMHead`): an untied head gets its own format (`head_format`), a tied one
reads its embedding's packed table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.platforms import current_platform

from . import importance
from .formats import IntFormat, TableFormat, machete, make_format
from .log import log_once
from .method import CompactEmbeddingMethod
from .settings import Decision, EmbedSettingsError, current_settings

#: Model tags vLLM sets (`set_model_tag`) while it builds a speculative-decoding drafter.
DRAFT_MODEL_TAGS = ("draft_model", "eagle_head", "medusa_head", "dflash_head", "dspark_head")


class CompactVocabParallelEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding` whose token table may be stored in a compact format."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, **kwargs):
        super().__init__(num_embeddings, embedding_dim, *args, **kwargs)
        _keep_prefix(self, kwargs)
        method = choose_method(self)
        if method is not None:
            self.quant_method = method
            # vLLM's fused TP lookup reads `weight` as a BF16 table; ours is packed.
            self.use_fused_embedding = False


class CompactParallelLMHead(ParallelLMHead):
    """`ParallelLMHead` whose logits may come from a packed table: its own, when the head is
    untied and `head_format` is set (converted after loading, like the embedding), or the
    embedding's, when it is tied to a converted embedding. Otherwise it is vLLM's head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, **kwargs):
        super().__init__(num_embeddings, embedding_dim, *args, **kwargs)
        _keep_prefix(self, kwargs)
        method = choose_head_method(self)
        if method is not None:
            self.quant_method = method

    def tie_weights(self, embed_tokens: VocabParallelEmbedding):
        if isinstance(self.quant_method, CompactEmbeddingMethod):
            # A model that ties a head its config calls untied: the table serves both.
            self.quant_method.cancel()
            self.quant_method = UnquantizedEmbeddingMethod()
        method = embed_tokens.quant_method
        if isinstance(method, CompactEmbeddingMethod):
            method.tie_head(self, embed_tokens)
            return self
        return super().tie_weights(embed_tokens)


def _keep_prefix(layer: VocabParallelEmbedding, kwargs: dict) -> None:
    """The layer's weight-name prefix, which logs and rules use to name it."""
    if not hasattr(layer, "prefix"):  # vLLM keeps it on the layer only from 0.32
        layer.prefix = kwargs.get("prefix", "")


@dataclass(frozen=True)
class _Table:
    """A vocabulary table of the model being built: whose it is and what the settings say."""

    vllm_config: Any
    role: str  # "target" | "draft"
    decision: Decision
    tied: bool
    where: str  # how logs and `check` name it, e.g. "target LM head lm_head"


def _vocabulary_table(layer: VocabParallelEmbedding, kind: str) -> _Table | None:
    """The table `layer` is, if it is a model's token table (or LM head) being built."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    role, model_config = _owning_model(vllm_config)
    text_config = model_config.hf_text_config
    if layer.org_vocab_size != getattr(text_config, "vocab_size", None):
        return None  # a position or token-type table, or a drafter's own small vocabulary
    decision = current_settings().decide(model_config.model)
    log_once(f"{role} {decision}")
    where = f"{role} {kind} {layer.prefix or kind}"
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    return _Table(vllm_config, role, decision, tied, where)


def choose_method(layer: VocabParallelEmbedding) -> CompactEmbeddingMethod | None:
    """The online method for this embedding, or None to leave it as vLLM built it."""
    table = _vocabulary_table(layer, "embedding")
    if table is None or not table.decision.convert:
        return None
    decision, where, tied = table.decision, table.where, table.tied
    if not _unquantized(layer, where):
        return None
    model_config = table.vllm_config.model_config
    if getattr(model_config, "word_embeddings_untied_by_checkpoint", False):  # newer vLLM only
        # vLLM re-ties such a head only to an unconverted table; converting would keep both.
        log_once(f"{where}: left in BF16, the checkpoint's lm_head may be re-tied to it")
        return None
    if decision.on_host and current_platform.is_cpu():
        log_once(
            f"{where}: format {decision.format!r} is a no-op on the CPU backend (the table already lives in host memory)"
        )
        return None
    name = decision.format
    if tied and decision.on_host:
        name = _tied_fallback(decision, where)
        if name == "off":
            return None
    if table.role == "draft" and replaced_by_target(table.vllm_config):
        log_once(
            f"{where}: vLLM swaps in the target's table for this MTP drafter's after loading; "
            "this copy is converted anyway, since vLLM 0.26 swaps only a table of the target's "
            "width, and is freed at the swap"
        )
    label = where + (" (tied LM head)" if tied else "")
    role = "tied" if tied else "lookup"
    column_importance = _importance(decision, name, layer.embedding_dim, where, role)
    fmt = make_format(name, decision.group_size, weighted=column_importance is not None)
    on_host = name == decision.format and decision.on_host
    if tied and not on_host:  # a tied host format's fallback lives on the GPU too
        fmt = _head_layout(fmt, layer, where)
    method = CompactEmbeddingMethod(
        fmt,
        label=label,
        on_error=current_settings().on_error,
        on_host=on_host,
        importance=column_importance,
    )
    _key_compile_cache(table.vllm_config, label, method)
    return method


def choose_head_method(layer: ParallelLMHead) -> CompactEmbeddingMethod | None:
    """The online method for an untied LM head (`head_format`), or None to leave it as vLLM
    built it. A tied head is decided by its embedding (`tie_weights`)."""
    table = _vocabulary_table(layer, "LM head")
    if table is None:
        return None
    decision, where = table.decision, table.where
    if table.tied:
        if decision.convert_head:
            log_once(
                f"{where}: tied to the embedding, so it is the embedding's table and follows "
                f"format={decision.format!r}; head_format={decision.head_format!r} is not used"
            )
        return None
    if not decision.convert_head:
        return None
    if table.role == "draft" and _built_by_proposer():
        # vLLM's EAGLE/MTP proposer swaps a drafter's head for the target's after loading
        # (MTP always; EAGLE when the drafter ships none, or an identical copy), so a
        # conversion here would be thrown away, or run on a weight that was never loaded.
        log_once(
            f"{where}: left as vLLM builds it (an EAGLE/MTP drafter either shares the "
            "target's head, converted, or keeps its own)"
        )
        return None
    if not _unquantized(layer, where):
        return None
    # The head's input is the hidden state the importance file measures: rows are rounded
    # jointly against it, as for a tied table.
    column_importance = _importance(
        decision, decision.head_format, layer.embedding_dim, where, "head"
    )
    fmt = make_format(
        decision.head_format, decision.group_size, weighted=column_importance is not None
    )
    fmt = _head_layout(fmt, layer, where)
    method = CompactEmbeddingMethod(
        fmt,
        label=where,
        role="lm_head",
        on_error=current_settings().on_error,
        importance=column_importance,
    )
    _key_compile_cache(table.vllm_config, where, method)
    return method


def _unquantized(layer: VocabParallelEmbedding, where: str) -> bool:
    """Whether vLLM built this table as plain BF16 (else the checkpoint's quantization has it)."""
    if isinstance(layer.quant_method, UnquantizedEmbeddingMethod):
        return True
    log_once(
        f"{where}: left as is, the checkpoint's quantization "
        f"({type(layer.quant_method).__name__}) already covers it"
    )
    return False


def _key_compile_cache(vllm_config, label: str, method: CompactEmbeddingMethod) -> None:
    """vLLM reuses a compiled forward from its cache when `VllmConfig.compute_hash()` matches,
    and that hash does not see this plugin: a graph compiled for BF16 (or another format)
    would be served for this one. `additional_config` is hashed, and read by nobody else under
    this key, so the plugin's decisions go there, before the forward is first compiled."""
    decision = {"format": method.fmt_key, "on_host": method.on_host}
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra.setdefault("vllm_embed_plugin", {})[label] = decision
        return
    # A platform put its own hashable object there: no room for ours, so no cache at all.
    vllm_config.compilation_config.inductor_compile_config["force_disable_caches"] = True
    log_once(
        "vLLM's additional_config is not a dict, so the plugin cannot key vLLM's compile "
        "cache on its format: the compile cache is switched off for this model"
    )


def _importance(decision, name: str, cols: int, where: str, role: importance.Role):
    """The column importance (`importance.py`), if one is set and the format uses it. It
    measures the LM head's input, so only a table that computes logits (a tied table or an
    untied head) uses it: its scales are searched and its rows rounded jointly against it (a
    tied table's with the lookup's cost added, where the file holds it). An untied embedding
    is converted exactly as without a file (a search for the head's columns measured worse for
    the lookup, docs/CALIBRATION.md), but the file is still checked, so one from another model
    stops startup either way."""
    if decision.importance is None:
        return None
    if not isinstance(make_format(name), IntFormat):
        log_once(f"{where}: format {name!r} has no scale search; the importance file is not used")
        return None
    try:
        loaded = importance.load(decision.importance, cols, role)
    except importance.ImportanceError as exc:
        raise EmbedSettingsError(
            f"importance (VLLM_EMBED_IMPORTANCE or a rule's importance): {exc}"
        ) from None
    if role == "lookup":
        log_once(
            f"{where}: untied, so the importance file is checked but not used here (it "
            "describes the LM head's input, not the lookup)"
        )
        return None
    return loaded


def _head_layout(fmt: TableFormat, layer: VocabParallelEmbedding, where: str) -> TableFormat:
    """`fmt` in Machete's layout when the tied head should run on vLLM's Machete GEMM
    (`head_kernel`), else `fmt` itself."""
    setting = current_settings().head_kernel
    if setting == "plugin" or (setting == "auto" and not current_platform.is_cuda()):
        return fmt
    reason = machete.unsupported(fmt, layer.embedding_dim) or _machete_unavailable(
        layer.params_dtype
    )
    if reason is None:
        return machete.MacheteLayout(fmt, layer.params_dtype)
    if setting == "machete":
        raise EmbedSettingsError(
            f"VLLM_EMBED_HEAD_KERNEL='machete': {where}: {reason}; Machete serves symmetric "
            f"int4 or int8 with groups of {' or '.join(map(str, machete.GROUP_SIZES))} on "
            "Hopper GPUs (set 'auto' to use it only where it can)"
        )
    log_once(f"{where}: tied head on the plugin's kernels, not vLLM's Machete ({reason})")
    return fmt


def _machete_unavailable(dtype: torch.dtype) -> str | None:
    """Why this process cannot run vLLM's Machete GEMM, or None."""
    if not current_platform.is_cuda():
        return "Machete runs on CUDA only"
    if not current_platform.is_device_capability(90):
        return "Machete needs a Hopper GPU (compute capability 9.0)"
    if dtype not in machete.SCALE_DTYPES:
        return f"Machete takes bfloat16 or float16 activations, not {dtype}"
    try:
        from vllm import _custom_ops  # noqa: F401  (registers torch.ops._C)
    except ImportError as exc:
        return f"vLLM's custom ops do not import ({exc})"
    if not hasattr(torch.ops._C, "machete_mm"):
        return "this vLLM build has no Machete kernels"
    return None


def _tied_fallback(decision, where: str) -> str:
    """A tied head computes logits from the table on the GPU, so a host table cannot serve it."""
    if decision.tied_fallback is None:
        raise EmbedSettingsError(
            f"{where}: format {decision.format!r} keeps the table in host memory, but this model's "
            "LM head is tied to it and must read it on the GPU; set tied_fallback (e.g. "
            "VLLM_EMBED_TIED_FALLBACK=int8, or per rule) or choose a device format"
        )
    log_once(
        f"{where}: LM head is tied, so {decision.format!r} falls back to {decision.tied_fallback!r}"
    )
    return decision.tied_fallback


def replaced_by_target(vllm_config) -> bool:
    """Whether vLLM will replace the drafter's embedding with the target's once both are loaded:
    an MTP drafter without pipeline parallelism (vLLM 0.26 and 0.32,
    `SpecDecodeBaseProposer._maybe_share_embeddings` and the V2 runner's `load_eagle_model`).
    An EAGLE drafter's fate is decided only after loading, by its checkpoint's contents."""
    spec = vllm_config.speculative_config
    return (
        spec is not None
        and spec.method == "mtp"
        and vllm_config.parallel_config.pipeline_parallel_size == 1
    )


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


def _built_by_proposer() -> bool:
    """Whether vLLM's EAGLE/MTP-style proposer is building a drafter now (a separate draft
    model, tag "draft_model", owns its head like any model)."""
    from vllm.compilation import backends

    return backends.model_tag in DRAFT_MODEL_TAGS and backends.model_tag != "draft_model"
