"""The vLLM contract: load the table as stock BF16, convert it once, then serve lookups (an
embedding) or logits (a tied table, or an untied LM head with its own format).

After conversion the layer holds `weight` (the packed codes, uint8 [rows, code_bytes]; for a
table in Machete's layout int32 words, `formats.machete`), `weight_scales` and, for affine
formats, `weight_mins`. `weight` keeps its name so code that reads `embed_tokens.weight`
(vLLM's draft-embedding sharing) still finds a tensor, and two identical tables still compare
equal.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

from . import kernels, memory
from .convert import quantize_table
from .formats import ColumnImportance, ConversionError, IdentityFormat, PackedRows, TableFormat
from .formats.machete import MacheteLayout
from .log import every, logger
from .memory import GiB

#: How often a long conversion logs its progress.
PROGRESS_SECONDS = 15.0


class CompactEmbeddingMethod(QuantizeMethodBase):
    """Online method for a vocabulary table: BF16 load -> `fmt` -> lookup (`role`
    "embedding") or logits (`apply`: an embedding's tied heads, or `role` "lm_head", an
    untied head converted on its own). Both roles convert, release and fail alike."""

    # vLLM's own load path builds the BF16 weight exactly as for an unquantized table.
    _bf16 = UnquantizedEmbeddingMethod()

    def __init__(
        self,
        fmt: TableFormat,
        label: str,
        on_error: str = "fail",
        on_host: bool = False,
        importance: ColumnImportance | None = None,
        role: str = "embedding",
    ):
        self.fmt = fmt
        #: "embedding" (lookups, and logits for tied heads) or "lm_head" (logits only).
        self.role = role
        #: How the compiled forward names the format to the kernels' custom ops.
        self.fmt_key = kernels.register_format(fmt)
        #: What an error in each column costs (`importance.py`); dropped after conversion.
        self.importance = importance
        self.label = label
        self.on_error = on_error
        #: Keep the table in pinned host memory, read through unified virtual addressing.
        self.on_host = on_host
        #: LM heads tied to this table; they read the packed table, never a BF16 copy.
        self.tied_heads: list[torch.nn.Module] = []
        #: The head's GEMM recorded per batch size: vLLM computes logits outside its graphs.
        self.head_graphs = kernels.HeadGraphs()
        memory.expect_conversion()

    def cancel(self) -> None:
        """This table will not be converted after all (its layer went back to vLLM's method)."""
        memory.conversion_finished()

    def tie_head(self, head: torch.nn.Module, embedding: torch.nn.Module) -> None:
        """Make `head` compute its logits from this embedding's packed table."""
        # The head's own BF16 weight is never loaded for a tied model: drop it now.
        del head.weight
        head.quant_method = TiedHeadMethod(embedding)
        self.tied_heads.append(head)

    def create_weights(self, layer, *args, **kwargs):
        self._bf16.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        if isinstance(self.fmt, IdentityFormat) and self.fmt.dtype != weight.dtype:
            # The lossless format keeps the table in the dtype it was loaded in.
            self.fmt = dataclasses.replace(self.fmt, dtype=weight.dtype)
            self.fmt_key = kernels.register_format(self.fmt)
        started = time.perf_counter()
        kernels.prepare(weight.device)  # resolve kernels now, never inside a traced forward
        try:
            # Builds the new tensors only; the layer is not touched until `_install`.
            packed, host_tensors = self._quantize(weight.data)
        except Exception as exc:
            self.importance = None
            memory.conversion_finished()
            if self.on_error == "fail":
                raise ConversionError(
                    f"vllm-embed-plugin: {self.label}: conversion to {self.fmt.name} failed ({exc}); "
                    "the layer was left unchanged. Set VLLM_EMBED_ON_ERROR=keep to serve it in BF16 instead."
                ) from exc
            logger.warning(
                "vllm-embed-plugin: %s: conversion to %s failed (%s); serving this table in BF16 (on_error=keep)",
                self.label,
                self.fmt.name,
                exc,
            )
            self._keep_bf16(layer)
            return
        self._install(layer, packed, host_tensors)
        rows, cols = weight.shape
        joint = self.importance is not None and self.importance.inverse_factor is not None
        logger.info(
            "vllm-embed-plugin: %s: %d x %d table -> %s, %.3f GiB -> %.3f GiB in %s, in %.2f s",
            self.label,
            rows,
            cols,
            self.fmt.describe(cols)
            + (", rows rounded jointly for the logits (GPTQ)" if joint else ""),
            weight.numel() * weight.element_size() / GiB,
            packed.nbytes / GiB,
            "pinned host memory (0 GiB of GPU memory)"
            if self.on_host
            else f"{weight.device.type} memory",
            time.perf_counter() - started,
        )
        del weight
        self.importance = None
        memory.conversion_finished()

    def _quantize(self, weight: torch.Tensor) -> tuple[PackedRows, PackedRows | None]:
        """(the packed table the layer will use, the pinned host tensors behind it or None)."""
        rows, cols = weight.shape
        # The scale search of an importance file takes minutes on a CPU: say it is alive.
        progress = every(PROGRESS_SECONDS, f"{self.label}: converting to {self.fmt.name}")
        if isinstance(self.fmt, MacheteLayout):
            # Quantized row-major first (the formats' own path), then vLLM prepacks it.
            rows_major = quantize_table(
                weight, self.fmt.row_format, importance=self.importance, progress=progress
            )
            return kernels.machete_repack(self.fmt, rows_major, cols), None
        if not self.on_host:
            return quantize_table(
                weight, self.fmt, importance=self.importance, progress=progress
            ), None
        host = self.fmt.empty(rows, cols, "cpu").map(lambda t: t.pin_memory())
        quantize_table(weight, self.fmt, out=host, importance=self.importance, progress=progress)
        return host.map(get_accelerator_view_from_cpu_tensor), host

    def _install(
        self, layer: torch.nn.Module, packed: PackedRows, host_tensors: PackedRows | None
    ) -> None:
        """Swap the BF16 table for the packed one (and point tied heads at it)."""
        layer.embedding_dtype = layer.weight.dtype
        layer.embedding_cols = layer.weight.shape[1]
        if host_tensors is not None:
            layer.host_tensors = host_tensors  # the device views do not own the memory
        del layer.weight
        for name, tensor in packed.tensors().items():
            attr = "weight" if name == "codes" else f"weight_{name}"
            layer.register_parameter(attr, Parameter(tensor, requires_grad=False))
        for head in self.tied_heads:
            head.weight = layer.weight  # the same packed tensor, so code reading .weight works

    def _keep_bf16(self, layer: torch.nn.Module) -> None:
        """Hand the untouched BF16 table (and any tied head) back to vLLM's own method."""
        layer.quant_method = UnquantizedEmbeddingMethod()
        layer.quant_method.process_weights_after_loading(layer)
        for head in self.tied_heads:
            head.weight = layer.weight
            head.quant_method = UnquantizedEmbeddingMethod()
            head.quant_method.process_weights_after_loading(head)

    @staticmethod
    def packed(layer: torch.nn.Module) -> PackedRows:
        return PackedRows(
            codes=layer.weight,
            scales=layer.weight_scales,
            mins=getattr(layer, "weight_mins", None),
        )

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return kernels.lookup(
            self.fmt_key, self.packed(layer), input_, layer.embedding_cols, layer.embedding_dtype
        )

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits: x @ table^T, from the packed table (weight-only kernel), for a tied head or
        an untied one. `bias` is what vLLM's logits processor passes, as for its own head."""
        logits = kernels.linear(
            self.fmt_key, self.packed(layer), x, layer.embedding_cols, graphs=self.head_graphs
        )
        return logits if bias is None else logits + bias


class TiedHeadMethod(QuantizeMethodBase):
    """The method of an LM head tied to a converted embedding: logits come from the
    embedding's packed table. The head owns no tensor of its own."""

    def __init__(self, embedding: torch.nn.Module):
        # Not a submodule: the embedding is processed and counted once, as itself.
        self._table_owner = [embedding]

    @property
    def table_owner(self) -> torch.nn.Module:
        """The converted embedding whose packed table this head reads."""
        return self._table_owner[0]

    def create_weights(self, layer, *args, **kwargs):
        raise RuntimeError("a tied head has no weights of its own")

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        owner = self.table_owner
        return owner.quant_method.apply(owner, x, bias)
