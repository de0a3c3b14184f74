"""Ballast release: give conversion scratch back once per model, after its last conversion.

Each embedding that will be converted is counted when it is built; when the last one of the
model being loaded has been converted, freed memory goes back to the allocator (CUDA) or to
the operating system (host `malloc_trim`), so vLLM's memory profiling sees the savings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import torch

GiB = 1 << 30

_pending = 0


def expect_conversion() -> None:
    global _pending
    _pending += 1


def conversion_finished() -> None:
    """Call once per expected conversion, whether it succeeded or not."""
    global _pending
    _pending = max(0, _pending - 1)
    if _pending == 0:
        release()


def pending() -> int:
    return _pending


def release() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
