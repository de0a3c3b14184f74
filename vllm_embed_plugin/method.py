"""The vLLM contract: load the table as stock BF16, convert it once, then serve lookups.

After conversion the layer holds `weight` (the packed codes, uint8 [rows, code_bytes]),
`weight_scales` and, for affine formats, `weight_mins`. `weight` keeps its name so code that
reads `embed_tokens.weight` (vLLM's draft-embedding sharing) still finds a tensor, and two
identical tables still compare equal.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from . import kernels, memory
from .formats import ConversionError, PackedRows, TableFormat, quantize_table

logger = logging.getLogger("vllm.embed_plugin")

GiB = 1 << 30


class CompactEmbeddingMethod(QuantizeMethodBase):
    """Online method for a token embedding: BF16 load -> `fmt` -> lookup."""

    # vLLM's own load path builds the BF16 weight exactly as for an unquantized table.
    _bf16 = UnquantizedEmbeddingMethod()

    def __init__(self, fmt: TableFormat, label: str):
        self.fmt = fmt
        self.label = label
        memory.expect_conversion()

    def create_weights(self, layer, *args, **kwargs):
        self._bf16.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        try:
            self._convert(layer)
        finally:
            memory.conversion_finished()

    def _convert(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        rows, cols = weight.shape
        before = weight.numel() * weight.element_size()
        start = time.perf_counter()
        try:
            packed = quantize_table(weight.data, self.fmt)
        except torch.OutOfMemoryError as exc:
            raise ConversionError(f"{self.label}: out of memory while converting: {exc}") from exc
        except ConversionError as exc:
            raise ConversionError(f"{self.label}: {exc}") from exc
        # Nothing above touched the layer; swap in the new tensors all at once.
        layer.embedding_dtype = weight.dtype
        layer.embedding_cols = cols
        del layer.weight
        for name, tensor in packed.tensors().items():
            attr = "weight" if name == "codes" else f"weight_{name}"
            layer.register_parameter(attr, Parameter(tensor, requires_grad=False))
        del weight
        seconds = time.perf_counter() - start
        logger.info(
            "vllm-embed-plugin: %s: %d x %d table -> %s, %.3f GiB -> %.3f GiB in %.2f s",
            self.label,
            rows,
            cols,
            self.fmt.describe(cols),
            before / GiB,
            packed.nbytes / GiB,
            seconds,
        )

    @staticmethod
    def packed(layer: torch.nn.Module) -> PackedRows:
        return PackedRows(
            codes=layer.weight,
            scales=layer.weight_scales,
            mins=getattr(layer, "weight_mins", None),
        )

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return kernels.lookup(self.fmt, self.packed(layer), input_, layer.embedding_cols, layer.embedding_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError("vllm-embed-plugin does not convert tied LM heads yet")
