"""Storage formats for embedding tables, by the name users select them with.

Each entry is a default; `make_format(name, group_size=...)` overrides the group size. Adding
a format or a bit width means adding a line here, nothing else.
"""

from __future__ import annotations

import dataclasses

from .base import ColumnImportance, ConversionError, PackedRows, TableFormat
from .fp8 import Fp8Format
from .identity import IdentityFormat
from .integer import IntFormat

FORMATS: dict[str, TableFormat] = {
    # Group-wise scales beat one scale per row at every width (docs/FIDELITY.md); the group
    # sizes keep int8 within 0.52x of BF16 and int5/int4 at llama.cpp's Q5_1/Q4_0 sizes.
    # int4 keeps Q4_0's layout: an affine group of 64 at the same 4.5 bits measured 8% lower
    # tied KLD with a calibration file, but its lookup and tied GEMM are 0.04-0.15x of BF16
    # slower (docs/BENCHMARKS.md).
    "int8": IntFormat("int8", bits=8, group_size=64, symmetric=True),  # 8.25 bits/weight
    "int6": IntFormat("int6", bits=6, group_size=64, symmetric=True),  # 6.25
    "int5": IntFormat("int5", bits=5, group_size=32, symmetric=False),  # 6.0, as Q5_1
    "int4": IntFormat("int4", bits=4, group_size=32, symmetric=True),  # 4.5, as Q4_0
    "fp8": Fp8Format("fp8", group_size=None),  # e4m3, one float32 scale per row: 8.05 at 640
}

#: Formats whose table lives in pinned host memory, read by the GPU through unified virtual
#: addressing: name -> the storage format of the table there.
HOST_FORMATS: dict[str, TableFormat] = {
    "host": IdentityFormat("host"),
    "host-int8": dataclasses.replace(FORMATS["int8"], name="host-int8"),
}

#: Group sizes a user may pick ("row" = one scale per row).
GROUP_SIZES = (16, 32, 64, 128, 256, "row")

#: Candidate scales tried on each side of the plain one when a column importance steers the
#: search (llama.cpp's make_qx_quants tries 2 * 9 + 1; 2 * 15 + 1 measured better at 4 and 5
#: bits). Without an importance the plain rules measure as well or better, so the search runs
#: only with one.
WEIGHTED_SEARCH = 15


def make_format(
    name: str, group_size: int | str | None = None, weighted: bool = False
) -> TableFormat:
    """The format called `name`, with its default group size unless one is given; `weighted`:
    a column importance will be passed to `quantize`, so integer formats search their scales."""
    fmt = FORMATS[name] if name in FORMATS else HOST_FORMATS[name]
    if group_size is not None and hasattr(fmt, "group_size"):
        fmt = dataclasses.replace(fmt, group_size=None if group_size == "row" else group_size)
    if weighted and isinstance(fmt, IntFormat):
        fmt = dataclasses.replace(fmt, search=WEIGHTED_SEARCH)
    return fmt


__all__ = [
    "ColumnImportance",
    "FORMATS",
    "GROUP_SIZES",
    "HOST_FORMATS",
    "WEIGHTED_SEARCH",
    "IdentityFormat",
    "ConversionError",
    "Fp8Format",
    "IntFormat",
    "PackedRows",
    "TableFormat",
    "make_format",
]
