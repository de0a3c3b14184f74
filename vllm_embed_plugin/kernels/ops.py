"""The two torch custom ops that vLLM's compiled forward calls: `vllm_embed::lookup` and
`vllm_embed::linear`.

vLLM runs the model forward under `torch.compile(fullgraph=True)` with guards dropped, then
replays it as CUDA graphs. To Dynamo each op is one opaque call whose fake implementation
gives the output's shape; the Python inside it (which kernel, which tiles for this many
tokens, how to view the codes) runs on real tensors: on every call in eager mode, and at
capture under CUDA graphs, so decode and prefill sizes each get their own tiling.

The format travels as a string key (`register_format`): ops take tensors and plain scalars.
No `from __future__ import annotations` here: `infer_schema` reads the annotations.
"""

from collections.abc import Callable
from typing import Optional

import torch

from ..formats import PackedRows, TableFormat

NAMESPACE = "vllm_embed"

#: Formats by key, filled when a layer is built (`register_format`), read inside the ops.
_FORMATS: dict[str, TableFormat] = {}


def register_format(fmt: TableFormat) -> str:
    """The key under which the ops find `fmt`: its full, deterministic repr (name, bits,
    group, symmetric...), so two formats that differ in anything get different keys."""
    key = repr(fmt)
    _FORMATS[key] = fmt
    return key


def format_of(key: str) -> TableFormat:
    try:
        return _FORMATS[key]
    except KeyError:
        raise KeyError(f"vllm-embed-plugin: format {key!r} was never registered") from None


def _define(name: str, impl: Callable, fake: Callable) -> None:
    """Define NAMESPACE::name for every backend, once per process (re-imports are harmless)."""
    if hasattr(getattr(torch.ops, NAMESPACE), name):
        return
    schema = torch.library.infer_schema(impl, mutates_args=())
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def _lookup_impl(
    ids: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: Optional[torch.Tensor],
    fmt_key: str,
    cols: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    from . import lookup_eager  # the package imports this module first

    return lookup_eager(format_of(fmt_key), _packed(codes, scales, mins), ids, cols, dtype)


def _lookup_fake(ids, codes, scales, mins, fmt_key, cols, dtype):
    return ids.new_empty((*ids.shape, cols), dtype=dtype)


def _linear_impl(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: Optional[torch.Tensor],
    fmt_key: str,
    cols: int,
) -> torch.Tensor:
    from . import linear_eager

    return linear_eager(format_of(fmt_key), _packed(codes, scales, mins), x, cols)


def _linear_fake(x, codes, scales, mins, fmt_key, cols):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _packed(codes, scales, mins) -> PackedRows:
    return PackedRows(codes=codes, scales=scales, mins=mins)


_define("lookup", _lookup_impl, _lookup_fake)
_define("linear", _linear_impl, _linear_fake)
