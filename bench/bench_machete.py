"""A table in Machete's layout (`VLLM_EMBED_HEAD_KERNEL`) on a Hopper GPU with vLLM: the tied
head through the plugin's op (vLLM's `machete_mm`) and the lookup that reads the same bytes,
against BF16 and the plugin's row-major tables in the same run.

    python bench/bench_machete.py --out machete.md

Times: CUDA events over CUDA-graph replays after warm-up (`bench_kernels.graph_time_us`), the
median of 3 runs for the GEMM. Tables: random codes and plausible scales, repacked by vLLM's
`machete_prepack_B`. 'exact' = the lookup kernel equals the torch reference on 64 random ids;
'same bits' = 10 calls of the GEMM give bit-identical logits at every M. The anchor row under
each Machete table is `machete_mm` with Machete's own schedule choice, as vLLM calls it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import lookup_time, md_table, median_time, random_packed  # noqa: E402

from vllm_embed_plugin import kernels  # noqa: E402
from vllm_embed_plugin.formats import IntFormat  # noqa: E402
from vllm_embed_plugin.formats.machete import MacheteLayout, unsupported  # noqa: E402
from vllm_embed_plugin.kernels import machete  # noqa: E402

TABLES = [(262144, 2560), (151936, 4096)]
MS = [1, 2, 4, 8, 16, 64, 128, 160, 256, 4096]
NS = [1, 8, 64, 256, 2048, 16384, 65536]
#: (label, the plugin's row-major format, the same in Machete's layout or None)
ROWS = [
    ("int8 g64", IntFormat("int8", 8, 64)),
    ("int4 g64", IntFormat("int4", 4, 64)),
    ("int4 g32 (row-major only)", IntFormat("int4", 4, 32)),
]


def machete_own_schedule(fmt: MacheteLayout, table, x: torch.Tensor) -> torch.Tensor:
    """`machete_mm` as vLLM calls it, with Machete's own schedule heuristic."""
    from vllm import _custom_ops as ops

    words, scales = fmt.machete_operands(table)
    return ops.machete_mm(
        a=x,
        b_q=words,
        b_type=machete._scalar_type(fmt.bits),
        b_group_scales=scales,
        b_group_size=fmt.group_size,
    )


def bench(rows: int, cols: int, log) -> str:
    xs = {m: torch.randn(m, cols, device="cuda").bfloat16() for m in MS}
    ids = {n: torch.randint(0, rows, (n,), device="cuda") for n in NS}
    weight = (torch.randn(rows, cols, device="cuda") * 0.02).bfloat16()
    bf_gemm = {m: median_time(lambda m=m: xs[m] @ weight.T, m) for m in MS}
    bf_lookup = {n: lookup_time(lambda n=n: F.embedding(ids[n], weight), n) for n in NS}
    del weight
    gemm_rows = [["BF16 cuBLAS"] + [f"{bf_gemm[m]:.0f} us" for m in MS]]
    lookup_rows = [["BF16 F.embedding"] + [f"{bf_lookup[n]:.1f} us" for n in NS] + ["-"]]
    for label, base in ROWS:
        packed = random_packed(base, rows, cols)
        layouts = [("row-major, plugin kernels", base, packed)]
        if unsupported(base, cols) is None:
            fmt = MacheteLayout(base)
            repacked = machete.repack(fmt, random_packed(base, rows, cols))
            layouts.append(("Machete layout", fmt, repacked))
        for where, fmt, table in layouts:
            name = f"{label}, {where}"
            gemm = {
                m: median_time(lambda m=m: kernels.linear(fmt, table, xs[m], cols), m) for m in MS
            }
            same = all(
                torch.equal(
                    kernels.linear(fmt, table, xs[m], cols), kernels.linear(fmt, table, xs[m], cols)
                )
                for m in MS
                for _ in range(5)
            )
            gemm_rows.append(
                [name + ("" if same else " (bits differ)")]
                + [f"{gemm[m]:.0f} us ({gemm[m] / bf_gemm[m]:.2f}x)" for m in MS]
            )
            look = {
                n: lookup_time(
                    lambda n=n: kernels.lookup(fmt, table, ids[n], cols, torch.bfloat16), n
                )
                for n in NS
            }
            exact = torch.equal(
                kernels.lookup(fmt, table, ids[64], cols, torch.bfloat16),
                kernels.lookup_torch(fmt, table, ids[64], cols, torch.bfloat16),
            )
            lookup_rows.append(
                [name] + [f"{look[n] / bf_lookup[n]:.2f}x" for n in NS] + ["yes" if exact else "NO"]
            )
            log(
                f"{rows}x{cols} {name}: gemm "
                + " ".join(f"{m}:{gemm[m] / bf_gemm[m]:.2f}" for m in MS)
            )
            if isinstance(fmt, MacheteLayout):  # the anchor: vLLM's own schedule choice
                own = {
                    m: median_time(lambda m=m: machete_own_schedule(fmt, table, xs[m]), m)
                    for m in MS
                }
                gemm_rows.append(
                    [f"{label}, Machete layout, vLLM's schedule (anchor)"]
                    + [f"{own[m]:.0f} us ({own[m] / bf_gemm[m]:.2f}x)" for m in MS]
                )
            log(
                f"{rows}x{cols} {name}: lookup "
                + " ".join(f"{n}:{look[n] / bf_lookup[n]:.2f}" for n in NS)
            )
            del table
        del packed, layouts
        torch.cuda.empty_cache()
    return (
        f"### {rows} x {cols}\n\nTied-head GEMM, ratio to BF16 cuBLAS:\n\n"
        + md_table(["table"] + [f"M={m}" for m in MS], gemm_rows)
        + "\n\nLookup, ratio to BF16 `F.embedding` (first row: BF16 time):\n\n"
        + md_table(["table"] + [f"n={n}" for n in NS] + ["exact"], lookup_rows)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--tables", default="0,1")
    args = ap.parse_args()

    def log(msg):
        print(msg, flush=True)

    props = torch.cuda.get_device_properties(0)
    head = (
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n"
        f"- device: {props.name}; torch {torch.__version__}\n"
        f"- command: `python bench/bench_machete.py {' '.join(sys.argv[1:])}`\n\n"
    )
    body = "\n".join(bench(*TABLES[int(i)], log) for i in args.tables.split(","))
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
