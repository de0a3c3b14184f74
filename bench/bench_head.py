"""The LM head as vLLM calls it, outside its CUDA graphs: GPU time and host (CPU) time per
call, every shipped format against BF16 cuBLAS, with vLLM's Machete and Marlin as anchors,
in one process.

    python bench/bench_head.py --out head.md
    python bench/bench_head.py --ms 1,64 --formats int8,int4 --tables 0   # a quick subset

- GPU us: the kernels' time, the mean over CUDA-graph replays (median of 3 runs).
- CPU us: host time of one eager call with the GPU held busy (`timing.cpu_time_us`), i.e.
  the launch cost that vLLM pays every decode step. 'op' is the custom op
  `vllm_embed::linear` launching the Triton kernels directly (the path before head graphs);
  'head' is `kernels.linear(..., graphs=HeadGraphs())`, what the plugin's method calls.
- same bits: 10 calls of the 'head' path give bit-identical logits, equal to the direct launch.
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

from bench_gemm import machete_setup, marlin_setup  # noqa: E402
from timing import cpu_time_us, gpu_target, md_table, median_time, random_packed  # noqa: E402

from vllm_embed_plugin import kernels  # noqa: E402
from vllm_embed_plugin.formats import FORMATS  # noqa: E402

TABLES = [(262144, 2560), (151936, 4096)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256, 4096]
SHIPPED = ["int8", "int6", "int5", "int4", "fp8"]
CPU_TARGET_US = 20.0


def mark(text: str, missed: bool) -> str:
    return f"**{text}**" if missed else text


def same_bits(call, direct) -> bool:
    first = call().clone()
    return torch.equal(first, direct()) and all(torch.equal(call(), first) for _ in range(9))


def bench_table(rows: int, cols: int, names: list[str], ms: list[int], anchors: bool, log):
    torch.manual_seed(0)
    weight = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") * 0.02
    packed = {name: random_packed(FORMATS[name], rows, cols) for name in names}
    keys = {name: kernels.register_format(FORMATS[name]) for name in names}
    anchor_fns = {}
    if anchors:
        for label, setup, bits, group in (
            ("Machete int8 g64", machete_setup, 8, 64),
            ("Machete int4 g64", machete_setup, 4, 64),
            ("Marlin int4 g128", marlin_setup, 4, 128),
        ):
            fn = setup(rows, cols, bits, group)
            if fn is not None:
                anchor_fns[label] = fn
    header = ["M", "BF16 GPU / CPU us"]
    header += [f"{n} GPU us (x BF16) / CPU us op -> head" for n in names]
    header += [f"{a} GPU us (x BF16) / CPU us" for a in anchor_fns]
    lines, raw = [], []
    for m in ms:
        x = torch.randn(m, cols, dtype=torch.bfloat16, device="cuda")
        bf_gpu = median_time(lambda: F.linear(x, weight), m)
        bf_cpu = cpu_time_us(lambda: F.linear(x, weight))
        row = [m, f"{bf_gpu:.0f} / {bf_cpu:.0f}"]
        for name in names:
            fmt, table, key = FORMATS[name], packed[name], keys[name]
            graphs = kernels.HeadGraphs()

            def op():
                return torch.ops.vllm_embed.linear(
                    x, table.codes, table.scales, table.mins, key, cols
                )

            def head():
                return kernels.linear(key, table, x, cols, graphs=graphs)

            def direct():
                return kernels.linear_eager(fmt, table, x, cols)

            gpu = median_time(direct, m)
            op_cpu, head_cpu = cpu_time_us(op), cpu_time_us(head)
            exact = same_bits(head, direct)
            tgt = gpu_target(name, m)
            ratio = gpu / bf_gpu
            text = mark(f"{gpu:.0f} ({ratio:.2f}x)", tgt is not None and ratio > tgt + 0.005)
            text += " / " + f"{op_cpu:.0f} -> " + mark(f"{head_cpu:.0f}", head_cpu > CPU_TARGET_US)
            row.append(text + ("" if exact else " **bits differ**"))
            raw.append(
                dict(
                    table=[rows, cols],
                    m=m,
                    format=name,
                    gpu_us=gpu,
                    bf16_gpu_us=bf_gpu,
                    op_cpu_us=op_cpu,
                    head_cpu_us=head_cpu,
                    bf16_cpu_us=bf_cpu,
                    same_bits=exact,
                )
            )
            del graphs
        for label, fn in anchor_fns.items():
            gpu = median_time(lambda: fn(x), m)
            cpu = cpu_time_us(lambda: fn(x))
            row.append(f"{gpu:.0f} ({gpu / bf_gpu:.2f}x) / {cpu:.0f}")
            raw.append(
                dict(
                    table=[rows, cols],
                    m=m,
                    format=label,
                    gpu_us=gpu,
                    bf16_gpu_us=bf_gpu,
                    head_cpu_us=cpu,
                )
            )
        lines.append(row)
        log(" | ".join(str(c) for c in row))
    return md_table(header, lines), raw


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--json", help="write the raw cells here")
    parser.add_argument("--tables", default="0,1", help="indices into TABLES (default: both)")
    parser.add_argument("--formats", default=",".join(SHIPPED), help="formats to time")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x to time")
    parser.add_argument("--no-anchor", action="store_true", help="skip Machete and Marlin")
    args = parser.parse_args()

    def log(text):
        print(text, flush=True)

    kernels.prepare("cuda")
    names = args.formats.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    props = torch.cuda.get_device_properties(0)
    parts = [
        f"# LM head: GPU and host time per call ({props.name}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"torch {torch.__version__}; `python bench/bench_head.py` (bold: a target missed; "
        f"CPU target {CPU_TARGET_US:.0f} us)\n",
    ]
    raw = []
    for index in map(int, args.tables.split(",")):
        rows, cols = TABLES[index]
        log(f"## {rows} x {cols}")
        md, cells = bench_table(rows, cols, names, ms, not args.no_anchor, log)
        parts.append(f"## {rows} x {cols}\n\n{md}\n")
        raw += cells
        torch.cuda.empty_cache()
    report = "\n".join(parts)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
