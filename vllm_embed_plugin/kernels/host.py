"""CUDA views of pinned host memory (zero-copy, through unified virtual addressing).

With UVA, pinned host memory has one address for the CPU and every GPU, so a kernel can read
it directly over the bus. vLLM ships `get_accelerator_view_from_cpu_tensor` for this; this is
the same in plain torch, for when that helper is missing (and for benchmarks without vLLM):
the tensor is handed to `torch.as_tensor` through `__cuda_array_interface__`, which wraps the
pointer without copying and keeps the host tensor alive for as long as the view lives.
Kernels reading the view are ordinary launches, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch

# __cuda_array_interface__ speaks numpy type strings; bfloat16 (and fp8) have none, so such
# tensors travel as same-width integers and are viewed back on the other side.
_TYPESTR = {
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.bool: "|b1",
}
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _PinnedArray:
    """Just enough of the CUDA array interface to describe a pinned tensor's memory."""

    def __init__(self, t: torch.Tensor):
        self._tensor = t  # keeps the host memory alive as long as the CUDA view does
        itemsize = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False),
            "strides": tuple(s * itemsize for s in t.stride()),
            "version": 3,
            "stream": None,
        }


def cuda_view_of_pinned(
    t: torch.Tensor, device: torch.device | str | int | None = None
) -> torch.Tensor:
    """A CUDA tensor aliasing pinned CPU tensor `t` (no copy): same shape, strides, dtype.

    Writes through either alias are seen by the other once the GPU work is synchronised."""
    if t.device.type != "cpu" or not t.is_pinned():
        raise ValueError("cuda_view_of_pinned needs a pinned CPU tensor (tensor.pin_memory())")
    dtype = t.dtype
    carrier = t if dtype in _TYPESTR else t.view(_CARRIER[t.element_size()])
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device or "cuda")
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device is None
        else torch.device(device)
    )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    view = torch.as_tensor(_PinnedArray(carrier), device=dev)
    if view.data_ptr() != t.data_ptr():  # as_tensor must alias, never copy
        raise RuntimeError("torch.as_tensor copied the pinned tensor instead of aliasing it")
    return view if dtype == carrier.dtype else view.view(dtype)
