"""GPU benchmarks of the lookup, tied-head GEMM, conversion and host-memory paths (no vLLM).

    python bench/bench_kernels.py --out docs/BENCHMARKS.md
    python bench/bench_kernels.py --sweep            # tile sweep behind the heuristics

Every time is the mean over CUDA-graph replays (CUDA events) after warm-up, measured against
BF16 (`F.embedding`, cuBLAS) in the same process. Tables are random: normal (std 0.02) for
BF16, random codes and scales for the packed formats (the kernels' speed does not depend on
the values). Roofline = bytes that must move (packed rows incl. scales and ids read, output
written) over 4.8 TB/s, the H200's datasheet bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import (  # noqa: E402
    event_time_us,
    graph_time_us,
    lookup_time,
    md_table,
    precompile,
    random_packed,
)

from vllm_embed_plugin import kernels  # noqa: E402
from vllm_embed_plugin.convert import quantize_table
from vllm_embed_plugin.formats import ColumnImportance, Fp8Format, IntFormat, make_format  # noqa: E402
from vllm_embed_plugin.formats.base import PackedRows, TableFormat  # noqa: E402

HBM = 4.8e12
TABLES = [(248320, 5120), (262144, 2560), (151936, 4096)]
NS = [1, 8, 64, 256, 2048, 16384, 65536]
FORMATS: list[tuple[str, TableFormat]] = [
    ("int8 per-row", IntFormat("int8", 8, None)),
    ("int8 g32", IntFormat("int8", 8, 32)),
    ("int8 g64", IntFormat("int8", 8, 64)),
    ("int6 per-row", IntFormat("int6", 6, None)),
    ("int6 g64", IntFormat("int6", 6, 64)),
    ("int5 affine g32", IntFormat("int5", 5, 32, symmetric=False)),
    ("int4 g32", IntFormat("int4", 4, 32)),
    ("int4 affine g32", IntFormat("int4", 4, 32, symmetric=False)),
    ("int4 affine g64", IntFormat("int4", 4, 64, symmetric=False)),
    ("fp8 per-row", Fp8Format("fp8", None)),
]
GEMM_TABLE = (262144, 2560)
GEMM_MS = [1, 16, 256, 4096]  # the sweep below; bench_gemm.py has the section's sizes
GEMM_FORMATS = [
    f for f in FORMATS if f[0] in ("int8 per-row", "int8 g64", "int4 g32", "int4 affine g64")
]
HOST_NS = [1, 64, 256, 2048, 65536]


# -- helpers -----------------------------------------------------------------------------------


def lookup_bytes(fmt: TableFormat, packed: PackedRows, n: int, cols: int, out_size: int = 2) -> int:
    row = sum(t.shape[1] * t.element_size() for t in packed.tensors().values())
    return n * (row + 8 + cols * out_size)


# -- sections ----------------------------------------------------------------------------------


def copy_bandwidth() -> float:
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = event_time_us(lambda: b.copy_(a), reps=20)
    del a, b
    return 2 * (1 << 31) / (us * 1e-6)


def bench_lookups(log, copy_bw, replays=200):
    from vllm_embed_plugin.kernels import triton_lookup

    jobs = []
    for rows, cols in TABLES:
        for _, fmt in FORMATS:
            for n in NS:
                spec = triton_lookup.spec_of(fmt, cols)
                cfg = triton_lookup.lookup_config(n, cols, spec)
                jobs.append(("lookup", fmt, cols, n, rows, cfg))
    precompile(_uniq(jobs))
    sections = []
    summary = {}
    for rows, cols in TABLES:
        weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
        ids_all = {n: torch.randint(0, rows, (n,), device="cuda") for n in NS}

        bf16 = {n: lookup_time(lambda n=n: F.embedding(ids_all[n], weight), n, replays) for n in NS}
        result_rows = [["BF16 F.embedding"] + [f"{bf16[n]:.1f} us" for n in NS] + ["-"]]
        roof_rows = []
        for label, fmt in FORMATS:
            packed = random_packed(fmt, rows, cols)
            # spot check against the reference on this very table
            ids = ids_all[64]
            exact = torch.equal(
                kernels.lookup(fmt, packed, ids, cols, torch.bfloat16),
                fmt.dequantize(packed.rows(ids), cols, torch.bfloat16),
            )
            times = {
                n: lookup_time(
                    lambda n=n: kernels.lookup(fmt, packed, ids_all[n], cols, torch.bfloat16),
                    n,
                    replays,
                )
                for n in NS
            }
            cells = [f"{times[n] / bf16[n]:.2f}x" for n in NS]
            result_rows.append([label] + cells + ["yes" if exact else "NO"])
            roof = []
            for n in (2048, 16384, 65536):
                nbytes = lookup_bytes(fmt, packed, n, cols)
                ideal = nbytes / HBM * 1e6
                roof.append(
                    f"{times[n]:.1f} us, {100 * ideal / times[n]:.0f}% ({100 * nbytes / (times[n] * 1e-6) / copy_bw:.0f}% of copy)"
                )
            roof_rows.append([label, f"{fmt.bits_per_weight(cols):.2f}"] + roof)
            summary[(rows, cols, label)] = (times, bf16)
            log(
                f"{rows}x{cols} {label}: "
                + " ".join(f"n={n}:{times[n]:.1f}us/{times[n] / bf16[n]:.2f}x" for n in NS)
            )
            del packed
        bf_roof = []
        for n in (2048, 16384, 65536):
            nbytes = n * (8 + cols * 4)
            bf_roof.append(
                f"{bf16[n]:.1f} us, {100 * nbytes / HBM * 1e6 / bf16[n]:.0f}% ({100 * nbytes / (bf16[n] * 1e-6) / copy_bw:.0f}% of copy)"
            )
        roof_rows.insert(0, ["BF16 F.embedding", "16"] + bf_roof)
        sections.append(
            f"### {rows} x {cols}\n\nTime relative to BF16 `F.embedding` (first row: BF16 time); "
            f"'exact' = bit-identical to `fmt.dequantize` on 64 random ids. BF16 itself takes "
            f"{bf16[8] / bf16[1]:.1f}x its n = 1 time at n = 8 ({bf16[8] / bf16[64]:.1f}x its "
            "n = 64 time): ratios at n = 8 show that baseline's irregularity, not a kernel win.\n\n"
            + md_table(["format"] + [f"n={n}" for n in NS] + ["exact"], result_rows)
            + "\n\nTime and share of the roofline (bytes / 4.8 TB/s; in brackets, of the measured copy bandwidth):\n\n"
            + md_table(["format", "bits/weight", "n=2048", "n=16384", "n=65536"], roof_rows)
        )
        del weight
        torch.cuda.empty_cache()
    return "\n\n".join(sections), summary


def bench_gemm(log):
    """The tied-head GEMM section: bench_gemm.py's tables (shipped heuristics, both shapes,
    BF16 cuBLAS and vLLM's Marlin beside them)."""
    import bench_gemm

    parts, summary = [], {}
    for rows, cols in bench_gemm.TABLES:
        md, res = bench_gemm.bench_table(rows, cols, False, log)
        parts.append(f"Table {rows} x {cols}, x and logits in BF16.\n\n{md}")
        summary[(rows, cols)] = res
    return "\n\n".join(parts), summary


def time_conversion(fn):
    """(seconds of a first and a second call, transient bytes, the packed result) of fn()."""
    times, peak, packed = [], 0, None
    for _ in range(2):
        del packed
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        packed = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base - packed.nbytes
    return times, peak, packed


def bench_conversion(log):
    rows, cols = TABLES[0]
    weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
    out_rows, summary = [], {}
    for label, fmt in [
        ("int8 per-row", IntFormat("int8", 8, None)),
        ("int8 g32", IntFormat("int8", 8, 32)),
        ("fp8 per-row", Fp8Format("fp8", None)),
    ]:
        results = {}
        for path in ("torch (convert.py)", "Triton quantize_rows_fast"):
            if path.startswith("torch"):
                fn = lambda: quantize_table(weight, fmt, fused=False)
            else:
                fn = lambda: kernels.quantize_rows_fast(fmt, weight)
            times, peak, results[path] = time_conversion(fn)
            out_rows.append(
                [label, path, f"{times[0]:.3f} s", f"{times[1]:.4f} s", f"{peak / 2**20:.0f} MiB"]
            )
            summary[(label, path)] = (times, peak)
            log(
                f"convert {label} {path}: first {times[0]:.3f}s second {times[1]:.4f}s peak {peak / 2**20:.0f} MiB"
            )
        a, b = results.values()
        exact = all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a.tensors().values(), b.tensors().values())
        )
        out_rows[-1].append("yes" if exact else "NO")
        out_rows[-2].append("-")
        del results, a, b
    # With a column importance (a random second moment with one massive column): the search
    # of WEIGHTED_SEARCH scales each side (untied tables), plus joint rounding (tied tables).
    hidden = torch.randn(4096, cols, device="cuda")
    hidden[:, 3] += 20.0
    moment = hidden.T @ hidden / hidden.shape[0]
    for joint in (False, True):
        importance = ColumnImportance.from_second_moment(moment, joint)
        for name in ("int8", "int5", "int4"):
            fmt = make_format(name, weighted=True)
            label = f"{_format_name(fmt)} + importance, {'tied' if joint else 'untied'}"
            times, peak, _ = time_conversion(
                lambda: quantize_table(weight, fmt, importance=importance)
            )
            path = f"torch, search {fmt.search} each side" + (
                " + Triton joint rounding" if joint else ""
            )
            out_rows.append(
                [
                    label,
                    path,
                    f"{times[0]:.3f} s",
                    f"{times[1]:.4f} s",
                    f"{peak / 2**20:.0f} MiB",
                    "-",
                ]
            )
            summary[(label, path)] = (times, peak)
            log(
                f"convert {label}: first {times[0]:.3f}s second {times[1]:.4f}s peak {peak / 2**20:.0f} MiB"
            )
    del weight
    torch.cuda.empty_cache()
    return (
        f"Table {rows} x {cols} BF16 on the GPU. Transient = peak allocated minus input and output. "
        "'first' includes Triton's compile; 'identical' = same bytes as the torch path.\n\n"
        + md_table(
            ["format", "path", "first call", "second call", "transient", "identical"], out_rows
        )
    ), summary


def _format_name(fmt: IntFormat) -> str:
    group = "per-row" if fmt.group_size is None else f"g{fmt.group_size}"
    return f"{fmt.name}{'' if fmt.symmetric else ' affine'} {group}"


def bench_host(log):
    from vllm_embed_plugin.kernels.host import cuda_view_of_pinned

    rows, cols = TABLES[0]
    fmt = IntFormat("int8", 8, None)
    weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
    host = torch.empty(rows, cols, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(weight)
    host_view = cuda_view_of_pinned(host)
    packed_host = random_packed(fmt, rows, cols, pin=True)
    packed_view = packed_host.map(cuda_view_of_pinned)
    packed_dev = packed_host.map(lambda t: t.to("cuda"))
    out_rows, summary = [], {}
    for n in HOST_NS:
        ids = torch.randint(0, rows, (n,), device="cuda")
        reps = 200 if n <= 2048 else 10
        exact = torch.equal(F.embedding(ids, host_view), F.embedding(ids, weight))
        exact8 = torch.equal(
            kernels.lookup(fmt, packed_view, ids, cols, torch.bfloat16),
            kernels.lookup(fmt, packed_dev, ids, cols, torch.bfloat16),
        )
        hbm = graph_time_us(lambda: F.embedding(ids, weight), reps)
        hbf = graph_time_us(lambda: F.embedding(ids, host_view), reps)
        h8 = graph_time_us(
            lambda: kernels.lookup(fmt, packed_view, ids, cols, torch.bfloat16), reps
        )
        gbs = lambda t, b: f"{b * n / (t * 1e-6) / 1e9:.0f}" if n >= 64 else "-"
        out_rows.append(
            [
                n,
                f"{hbm:.1f}",
                f"{hbf:.1f} ({gbs(hbf, cols * 2)} GB/s)",
                f"{h8:.1f} ({gbs(h8, cols + 4)} GB/s)",
                f"{hbf - hbm:+.1f} / {h8 - hbm:+.1f}",
                "yes" if exact and exact8 else "NO",
            ]
        )
        summary[n] = (hbm, hbf, h8)
        log(
            f"host n={n}: hbm {hbm:.1f} host-bf16 {hbf:.1f} host-int8 {h8:.1f} exact {exact and exact8}"
        )
    del host_view, packed_view, host, packed_host, packed_dev, weight
    torch.cuda.empty_cache()
    return (
        f"Table {rows} x {cols}. 'host BF16' = `F.embedding` on a CUDA view of the pinned BF16 table "
        "(`kernels.host.cuda_view_of_pinned`); 'host int8' = the fused lookup reading a pinned per-row "
        "int8 table (codes and scales) through such views. GB/s = table bytes read from the host. "
        "'exact' = bit-identical to the same lookup from HBM.\n\n"
        + md_table(
            [
                "tokens",
                "BF16 in HBM us",
                "host BF16 us",
                "host int8 us",
                "overhead vs HBM (BF16 / int8) us",
                "exact",
            ],
            out_rows,
        )
    ), summary


# -- sweep -------------------------------------------------------------------------------------


def _uniq(jobs):
    seen, out = set(), []
    for j in jobs:
        key = (repr(j[1]), j[2], j[3] == 1, repr(j[5]))
        if key not in seen:
            seen.add(key)
            out.append(j)
    return out


def sweep(log, what):
    from vllm_embed_plugin.kernels import triton_linear, triton_lookup

    if "lookup" in what:
        fmts = [FORMATS[0], FORMATS[4], FORMATS[6], FORMATS[3]]
        cfgs = [(1, 128, 1), (1, 128, 2), (2, 128, 2), (2, 128, 4), (4, 64, 2)]
        cfgs = cfgs + [c + (True,) for c in cfgs]
        cases = [((248320, 5120), 65536), ((262144, 2560), 65536), ((248320, 5120), 16384)]
        jobs = [
            ("lookup", fmt, cols, n, rows, c)
            for (rows, cols), n in cases
            for _, fmt in fmts
            for c in cfgs
        ]
        precompile(_uniq(jobs), workers=14)
        for (rows, cols), n in cases:
            weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
            ids = torch.randint(0, rows, (n,), device="cuda")
            bf = graph_time_us(lambda: F.embedding(ids, weight), 100)
            del weight
            for label, fmt in fmts:
                packed = random_packed(fmt, rows, cols)
                res = sorted(
                    (
                        graph_time_us(
                            lambda: triton_lookup.lookup(
                                fmt, packed, ids, cols, torch.bfloat16, config=c
                            ),
                            100,
                        ),
                        c,
                    )
                    for c in cfgs
                )
                roof = lookup_bytes(fmt, packed, n, cols) / HBM * 1e6
                log(
                    f"SWEEP {rows}x{cols} n={n} {label}: bf16 {bf:.1f} | best "
                    + ", ".join(f"{c}:{t:.1f}({100 * roof / t:.0f}%)" for t, c in res[:5])
                    + f" | worst {res[-1][1]}:{res[-1][0]:.1f}"
                )
                del packed
            torch.cuda.empty_cache()
    if "gemm" in what:
        rows, cols = GEMM_TABLE
        fmts = GEMM_FORMATS[:2]
        gemv = [
            dict(GEMV=True, BN=bn, BK=bk, num_warps=w, num_stages=1)
            for bn in (8, 16, 32)
            for bk in (128, 256, 512)
            for w in (2, 4, 8)
            if 8 <= bn * bk // (32 * w) <= 64
        ]
        tiled = [
            dict(BM=16, BN=bn, BK=bk, SWAP=True, num_warps=4, num_stages=st)
            for bn in (32, 64, 128)
            for bk in (128, 256)
            for st in (2, 4)
        ]
        plan = {
            1: gemv,
            4: gemv[:0]
            + [
                dict(GEMV=True, BN=16, BK=bk, num_warps=w, num_stages=1)
                for bk in (64, 128)
                for w in (2, 4)
            ]
            + tiled,
            16: tiled,
        }
        jobs = [
            ("linear", fmt, cols, m, rows, c)
            for _, fmt in fmts
            for m, cs in plan.items()
            for c in cs
        ]
        jobs += [("linear", fmt, cols, m, rows, None) for _, fmt in fmts for m in (1, 4, 16)]
        precompile(_uniq(jobs), workers=14)
        weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
        for m, cs in plan.items():
            x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
            bf = graph_time_us(lambda: x @ weight.T, 50)
            for label, fmt in fmts:
                packed = random_packed(fmt, rows, cols)
                td = graph_time_us(lambda: kernels.linear(fmt, packed, x, cols), 50)
                res = []
                for cfg in cs:
                    try:
                        t = graph_time_us(
                            lambda: triton_linear.linear(fmt, packed, x, cols, config=cfg), 30
                        )
                    except Exception as exc:  # e.g. out of shared memory
                        log(f"  cfg {cfg} failed: {str(exc)[:100]}")
                        continue
                    res.append((t, cfg))
                res.sort(key=lambda r: r[0])
                fmt_cfg = lambda c: (
                    ("gemv " if c.get("GEMV") else f"{c.get('BM')}/")
                    + f"{c['BN']}/{c['BK']}/w{c['num_warps']}/s{c['num_stages']}"
                )
                log(
                    f"GSWEEP M={m} {label}: bf16 {bf:.0f} default {td:.0f} ({td / bf:.2f}x) | "
                    + ", ".join(f"{fmt_cfg(c)}:{t:.0f}" for t, c in res[:6])
                )
                del packed
        del weight


def profile_gemm(cfgs):
    """One call of each config (for ncu)."""
    rows, cols = GEMM_TABLE
    for (_label, fmt), m, cfg in cfgs:
        packed = random_packed(fmt, rows, cols)
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        for _ in range(2):
            kernels.linear(fmt, packed, x, cols) if cfg is None else __import__(
                "vllm_embed_plugin.kernels.triton_linear", fromlist=["x"]
            ).linear(fmt, packed, x, cols, config=cfg)
        torch.cuda.synchronize()


# -- main --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--sweep", default="", help="run a tile sweep instead: lookup,gemm")
    ap.add_argument("--profile", action="store_true", help="a few GEMM calls, for ncu")
    ap.add_argument("--only", default="lookup,gemm,conversion,host")
    args = ap.parse_args()
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    torch.manual_seed(0)
    if args.profile:
        profile_gemm(
            [
                (
                    GEMM_FORMATS[0],
                    1,
                    dict(BM=16, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=4, FAST=False),
                ),
                (
                    GEMM_FORMATS[1],
                    1,
                    dict(BM=16, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=4, FAST=False),
                ),
            ]
        )
        return
    if args.sweep:
        copy_bw = copy_bandwidth()
        log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
        sweep(log, args.sweep)
        return
    import triton

    t_start = time.perf_counter()
    copy_bw = copy_bandwidth()
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    only = set(args.only.split(","))
    parts = {}
    if "lookup" in only:
        parts["lookup"], _ = bench_lookups(log, copy_bw)
    if "gemm" in only:
        parts["gemm"], _ = bench_gemm(log)
    if "conversion" in only:
        parts["conversion"], _ = bench_conversion(log)
    if "host" in only:
        parts["host"], _ = bench_host(log)
    elapsed = time.perf_counter() - t_start
    props = torch.cuda.get_device_properties(0)
    head = f"""# Kernel benchmarks

Written by `bench/bench_kernels.py`; do not edit by hand.

- command: `python bench/bench_kernels.py {" ".join(sys.argv[1:])}`
- date: {datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
- device: {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), driver CUDA {torch.version.cuda}
- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}
- method: mean over CUDA-graph replays after warm-up, timed with CUDA events; BF16 baselines
  measured in the same run. Lookups with n <= 256: graphs of 20 lookups, 50 replays (the
  per-lookup time inside a captured forward; one-lookup graphs measure the CPU's graph-launch
  rate, which drifted between 2.9 and 5.2 us per replay on this machine); larger n: one lookup
  per graph, 200 replays. GEMM: 200 replays (M <= 16), 100 (256), 10 (4096). Host reads: 200
  replays (n <= 2048), 10 (65536).
  Random tables: BF16 normal (std 0.02); packed formats random codes and scales.
- measured device-to-device copy bandwidth (bytes read + written): {copy_bw / 1e12:.2f} TB/s
  ({100 * copy_bw / HBM:.0f}% of the 4.8 TB/s datasheet figure the roofline uses)
- whole run: {elapsed:.0f} s
"""
    body = [head]
    if "lookup" in parts:
        body.append(
            "## Lookup (embedding gather + unpack + dequantize), output BF16\n\n" + parts["lookup"]
        )
    if "gemm" in parts:
        body.append("## Tied LM head: logits = x @ W^T\n\n" + parts["gemm"])
    if "conversion" in parts:
        body.append(
            "## Conversion on the GPU (convert.quantize_table vs the one-pass kernel)\n\n"
            + parts["conversion"]
        )
    if "host" in parts:
        body.append("## Table in pinned host memory (UVA, zero-copy)\n\n" + parts["host"])
    text = "\n\n".join(body) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
