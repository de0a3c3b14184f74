"""Storage formats for embedding tables, by the name users select them with.

Each entry is a default; `make_format(name, group_size=...)` overrides the group size. Adding
a format or a bit width means adding a line here, nothing else.
"""

from __future__ import annotations

import dataclasses

from .base import ConversionError, PackedRows, TableFormat
from .convert import quantize_table
from .fp8 import Fp8Format
from .identity import IdentityFormat
from .integer import IntFormat

FORMATS: dict[str, TableFormat] = {
    "int8": IntFormat("int8", bits=8, group_size=None, symmetric=True),
}

#: Formats whose table lives in pinned host memory, read by the GPU through unified virtual
#: addressing: name -> the storage format of the table there.
HOST_FORMATS: dict[str, TableFormat] = {
    "host": IdentityFormat("host"),
    "host-int8": dataclasses.replace(FORMATS["int8"], name="host-int8"),
}

#: Group sizes a user may pick (None = one scale per row).
GROUP_SIZES = (16, 32, 64, 128, 256)


def make_format(name: str, group_size: int | None = None) -> TableFormat:
    """The format called `name`, with its default group size unless one is given."""
    fmt = FORMATS[name] if name in FORMATS else HOST_FORMATS[name]
    if group_size is not None and hasattr(fmt, "group_size"):
        fmt = dataclasses.replace(fmt, group_size=group_size)
    return fmt


__all__ = [
    "FORMATS",
    "GROUP_SIZES",
    "HOST_FORMATS",
    "IdentityFormat",
    "ConversionError",
    "Fp8Format",
    "IntFormat",
    "PackedRows",
    "TableFormat",
    "make_format",
    "quantize_table",
]
