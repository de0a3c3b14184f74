"""GPU memory of a packed table's calls, against BF16: what the plugin adds to vLLM's
profiling run, whose peak vLLM subtracts from the KV cache.

    python bench/head_memory.py --formats int8,int4 --ms 1,64,256,1024 --lookup 8192

For each call: the peak of allocated memory during the call above what was allocated before
it, and what is still allocated after it (the result dropped), for the plugin's first call
(the head records its CUDA graph there, as in vLLM's profiling run) and for BF16's
`F.linear` / `F.embedding` on the same shape. 'extra' = plugin minus BF16.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import md_table, random_packed  # noqa: E402

from vllm_embed_plugin import kernels  # noqa: E402
from vllm_embed_plugin.formats import FORMATS  # noqa: E402

MIB = 1 << 20


def footprint(call) -> tuple[float, float]:
    """(peak during call, still allocated after it with the result dropped), in MiB above
    what was allocated before."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    gc.collect()
    torch.cuda.synchronize()
    return peak / MIB, (torch.cuda.memory_allocated() - before) / MIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=151936, help="table rows (vocabulary)")
    parser.add_argument("--cols", type=int, default=4096, help="table width (hidden size)")
    parser.add_argument("--formats", default="int8,int4", help="formats to measure")
    parser.add_argument("--ms", default="1,64,256,1024", help="rows of x of the head calls")
    parser.add_argument("--lookup", type=int, default=8192, help="tokens of the lookup call")
    parser.add_argument("--out", help="write the Markdown report here")
    args = parser.parse_args()
    rows, cols = args.rows, args.cols
    torch.manual_seed(0)
    weight = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") * 0.02
    ms = [int(m) for m in args.ms.split(",")]
    names = args.formats.split(",")
    header = ["call", "BF16 peak / after MiB"] + [
        f"{n} peak / after MiB (extra peak)" for n in names
    ]
    lines = []
    ids = torch.randint(0, rows, (args.lookup,), device="cuda")
    bf_peak, bf_after = footprint(lambda: F.embedding(ids, weight))
    tables = {name: random_packed(FORMATS[name], rows, cols) for name in names}
    keys = {name: kernels.register_format(FORMATS[name]) for name in names}
    row = [f"lookup n={args.lookup}", f"{bf_peak:.1f} / {bf_after:.1f}"]
    for name in names:
        table, key = tables[name], keys[name]
        peak, after = footprint(lambda: kernels.lookup(key, table, ids, cols, torch.bfloat16))
        row.append(f"{peak:.1f} / {after:.1f} ({peak - bf_peak:+.1f})")
    lines.append(row)
    for m in ms:
        x = torch.randn(m, cols, dtype=torch.bfloat16, device="cuda")
        bf_peak, bf_after = footprint(lambda: F.linear(x, weight))
        row = [f"head M={m}", f"{bf_peak:.1f} / {bf_after:.1f}"]
        for name in names:
            table, key = tables[name], keys[name]
            graphs = kernels.HeadGraphs()
            peak, after = footprint(lambda: kernels.linear(key, table, x, cols, graphs=graphs))
            again, _ = footprint(lambda: kernels.linear(key, table, x, cols, graphs=graphs))
            row.append(f"{peak:.1f} / {after:.1f} ({peak - bf_peak:+.1f}; replay {again:.1f})")
            del graphs
        lines.append(row)
    report = (
        f"# Memory of a packed table's calls, {rows} x {cols}, {torch.cuda.get_device_name(0)}\n\n"
        + md_table(header, lines)
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
