"""Lookup and tied-head matmul over packed tables: fused GPU kernels where they exist,
torch reference paths everywhere else. Imports neither vLLM nor the settings.

`lookup` and `linear` are what a model's forward calls: each is one torch custom op
(`ops.py`), so `torch.compile(fullgraph=True)` traces them as single calls and CUDA graphs
capture them. Inside the op, `lookup_eager` / `linear_eager` pick the kernel on real tensors.

Triton modules are resolved by `prepare(device)` when a layer is converted, never inside a
traced forward. `VLLM_EMBED_NO_TRITON=1` forces the torch paths everywhere (for comparisons).
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from ..formats import ConversionError, IdentityFormat, IntFormat, PackedRows, TableFormat
from ..formats.machete import MacheteLayout
from .head_graphs import HeadGraphs
from .ops import format_of, register_format

#: Bound on the dense float chunk the torch `linear` path materialises at a time.
LINEAR_CHUNK_BYTES = 64 << 20
#: Rows at or below which the CPU uses torch's int8 weight-only GEMV (ANCHORS 2b).
INT8PACK_MAX_ROWS = 8
#: The Triton modules, imported together by `prepare` on the first CUDA device.
TRITON_MODULES = ("triton_lookup", "triton_linear", "triton_quantize", "triton_joint", "machete")

_triton: dict[str, object] = {}
#: `VLLM_EMBED_NO_HEAD_GRAPHS=1`: the head launches through its op on every call, as before
#: head graphs (for comparisons).
_NO_HEAD_GRAPHS = os.environ.get("VLLM_EMBED_NO_HEAD_GRAPHS", "") in ("1", "true", "yes")


def prepare(device: torch.device | str) -> None:
    """Resolve the kernels for `device` now (load time): importing Triton modules inside a
    forward that torch.compile traces would break the graph."""
    if torch.device(device).type == "cuda":
        for name in TRITON_MODULES:
            _triton_module(name)


def _triton_module(name: str):
    """kernels.<name> if Triton (and, for `machete`, vLLM's ops) imports and is not switched
    off, else None (cached)."""
    if name not in _triton:
        module = None
        if os.environ.get("VLLM_EMBED_NO_TRITON", "") not in ("1", "true", "yes"):
            try:
                module = importlib.import_module(f"{__name__}.{name}")
            except ImportError:
                module = None
        _triton[name] = module
    return _triton[name]


def _key(fmt: TableFormat | str) -> str:
    return fmt if isinstance(fmt, str) else register_format(fmt)


def lookup(
    fmt: TableFormat | str, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of the table, dequantized to `dtype`: shape ids.shape + (cols,). `fmt` is a
    format or its key from `register_format` (a layer passes the key: no Python on the format
    object in a traced forward). One custom op; no host synchronisation."""
    return torch.ops.vllm_embed.lookup(
        ids, table.codes, table.scales, table.mins, _key(fmt), cols, dtype
    )


def linear(
    fmt: TableFormat | str,
    table: PackedRows,
    x: torch.Tensor,
    cols: int,
    graphs: HeadGraphs | None = None,
) -> torch.Tensor:
    """LM head: x [..., cols] @ dequant(table)^T -> [..., rows] in x.dtype, without ever
    densifying the whole table. One custom op; called eagerly (as vLLM computes its logits)
    with `graphs`, the table's `HeadGraphs`, it replays the call's CUDA graph instead: see
    head_graphs.py for why, and for the lifetime of the logits it returns."""
    if graphs is not None and not torch.compiler.is_compiling():
        fmt = format_of(fmt) if isinstance(fmt, str) else fmt
        if _graphable(fmt, table, x):
            key = (table.codes.data_ptr(), table.scales.data_ptr(), _data_ptr(table.mins), x.dtype)
            x2 = x if x.dim() == 2 else x.reshape(-1, cols)
            out = graphs.logits(
                lambda xs, dest: linear_eager(fmt, table, xs, cols, out=dest),
                key,
                x2,
                table.num_rows,
            )
            if out is not None:
                return out if x.dim() == 2 else out.view(*x.shape[:-1], table.num_rows)
    return torch.ops.vllm_embed.linear(x, table.codes, table.scales, table.mins, _key(fmt), cols)


def _graphable(fmt: TableFormat, table: PackedRows, x: torch.Tensor) -> bool:
    """Whether the head call goes through a recorded graph: the plugin's Triton GEMM on CUDA
    (Machete's and cuBLAS's own launches are cheap on the host)."""
    return (
        x.is_cuda
        and table.codes.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and not isinstance(fmt, (IdentityFormat, MacheteLayout))
        and not _NO_HEAD_GRAPHS
        and _triton_module("triton_linear") is not None
    )


def _data_ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def lookup_eager(
    fmt: TableFormat, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """The op's body: the fused kernel on CUDA, else the torch reference path."""
    if isinstance(fmt, IdentityFormat):  # a plain table (e.g. in host memory): one gather
        return F.embedding(ids, table.codes).to(dtype)
    if ids.is_cuda and table.codes.is_cuda:
        kernels = _triton_module("machete" if isinstance(fmt, MacheteLayout) else "triton_lookup")
        if kernels is not None:
            out = kernels.lookup(fmt, table, ids, cols, dtype)
            if out is not None:
                return out
    return lookup_torch(fmt, table, ids, cols, dtype)


def lookup_torch(
    fmt: TableFormat, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference path: gather the packed rows, then dequantize them."""
    flat = ids.reshape(-1)
    out = fmt.dequantize_rows(table, flat, cols, dtype)
    return out.view(*ids.shape, cols)


def linear_eager(
    fmt: TableFormat,
    table: PackedRows,
    x: torch.Tensor,
    cols: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's body: the Triton weight-only GEMM on CUDA, else the torch path. With `out`
    ([m, rows], m = the rows of x) the logits are written there."""
    result = None
    if isinstance(fmt, IdentityFormat) and x.dtype == table.codes.dtype:
        result = F.linear(x, table.codes)
    elif x.is_cuda and table.codes.is_cuda:
        if isinstance(fmt, MacheteLayout):
            kernels = _triton_module("machete")
            result = kernels.linear(fmt, table, x, cols) if kernels is not None else None
        elif (kernels := _triton_module("triton_linear")) is not None:
            result = kernels.linear(fmt, table, x, cols, out=out)
    if result is None:
        result = linear_torch(fmt, table, x, cols)
    if out is None or result.data_ptr() == out.data_ptr():
        return result
    out.copy_(result.reshape(out.shape))
    return out


def _is_int8_per_row(fmt: TableFormat) -> bool:
    return isinstance(fmt, IntFormat) and fmt.bits == 8 and fmt.group_size is None and fmt.symmetric


def linear_torch(
    fmt: TableFormat,
    table: PackedRows,
    x: torch.Tensor,
    cols: int,
    chunk_bytes: int = LINEAR_CHUNK_BYTES,
) -> torch.Tensor:
    """The torch path. On the CPU, a per-row symmetric int8 table at decode sizes goes through
    `torch._weight_int8pack_mm` (int8 weights read directly); everything else dequantizes
    bounded row chunks and multiplies them, never the whole table at once."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    m, rows = x2.shape[0], table.num_rows
    if (
        x2.device.type == "cpu"
        and _is_int8_per_row(fmt)
        and 0 < m <= INT8PACK_MAX_ROWS
        and cols % 8 == 0  # codes rows are then exactly the int8 weight rows (no copy)
        and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
    ):
        weight = table.codes.view(torch.int8)
        out = torch._weight_int8pack_mm(
            x2.contiguous(), weight, table.scales.reshape(-1).to(x2.dtype)
        )
        return out.view(*lead, rows)
    out = torch.empty((m, rows), dtype=x.dtype, device=x.device)
    # Dequantize creates a few float32 temporaries per element; bound them all.
    step = max(1, chunk_bytes // (max(cols, 1) * 16))
    for start in range(0, rows, step):
        weight = fmt.dequantize_rows(table, slice(start, start + step), cols, x.dtype)
        out[:, start : start + step] = x2 @ weight.T
        del weight
    return out.view(*lead, rows)


def quantize_rows_fast(
    fmt: TableFormat, rows: torch.Tensor, out: PackedRows | None = None
) -> PackedRows | None:
    """One-pass GPU conversion of a whole table for the formats the Triton kernel handles
    (8-bit int or fp8, no scale search), into `out` if given (device or pinned host storage);
    None means: use the chunked torch path. Raises ConversionError on NaN/Inf rows."""
    if not rows.is_cuda:
        return None
    kernels = _triton_module("triton_quantize")
    if kernels is None:
        return None
    return kernels.quantize_rows_fast(fmt, rows, out)


def machete_repack(fmt: MacheteLayout, packed: PackedRows, cols: int) -> PackedRows:
    """A row-major table of `fmt.row_format` in Machete's layout: on CUDA by vLLM's own
    `machete_prepack_B` (`kernels.machete`; ConversionError where vLLM has none), elsewhere
    by the torch reference."""
    if not packed.codes.is_cuda:
        return fmt.from_rows(packed, cols)
    kernels = _triton_module("machete")
    if kernels is None:
        raise ConversionError("Machete's layout needs Triton and vLLM's machete ops on CUDA")
    return kernels.repack(fmt, packed)


def round_group_jointly_fast(
    values: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    factor: torch.Tensor,
    bits: int,
    symmetric: bool,
):
    """GPTQ's rounding of one group on CUDA (see `formats.integer.round_jointly`); None means:
    use the torch loop."""
    if not values.is_cuda:
        return None
    kernels = _triton_module("triton_joint")
    if kernels is None:
        return None
    return kernels.round_group_jointly(values, step, low, factor, bits, symmetric)


__all__ = [
    "HeadGraphs",
    "format_of",
    "linear",
    "linear_eager",
    "linear_torch",
    "lookup",
    "lookup_eager",
    "lookup_torch",
    "machete_repack",
    "prepare",
    "quantize_rows_fast",
    "register_format",
    "round_group_jointly_fast",
]
