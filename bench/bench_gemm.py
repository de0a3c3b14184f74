"""Tied-head GEMM on the GPU: logits [M, rows] = x [M, cols] @ dequant(W)^T, every shipped
format against BF16 cuBLAS and vLLM's Marlin in the same process (no vLLM needed, except for
the Marlin anchor, skipped when `vllm._C` does not import).

    python bench/bench_gemm.py --out gemm.md            # the shipped heuristics
    python bench/bench_gemm.py --sweep --out gemm.md    # also time candidate configs

Times: mean over CUDA-graph replays (CUDA events) after warm-up, the median of 3 such runs.
Tables are random codes and plausible scales (`bench_kernels.random_packed`); x is N(0, 1).
'same bits' = 10 calls of the timed path give bit-identical logits. 'rel. error' = Frobenius
relative error against x @ dequant(W)^T in float32 on the first 8192 rows (M = 16).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import graph_time_us, md_table, precompile, random_packed  # noqa: E402

from vllm_embed_plugin.formats import FORMATS  # noqa: E402
from vllm_embed_plugin.kernels import triton_linear  # noqa: E402
from vllm_embed_plugin.kernels.triton_lookup import spec_of  # noqa: E402

TABLES = [(262144, 2560), (151936, 4096)]
MS = [1, 2, 4, 8, 16, 64, 256, 4096]
SHIPPED = ["int8", "int6", "int5", "int4", "fp8"]
TARGETS = {"int8": 0.60, "int6": 0.50, "int5": 0.50, "int4": 0.40, "fp8": 0.60}


def label(name: str) -> str:
    fmt = FORMATS[name]
    g = getattr(fmt, "group_size", None)
    kind = "" if getattr(fmt, "symmetric", True) else " affine"
    return f"{name}{kind} {'per-row' if g is None else f'g{g}'}"


def candidates(m: int, bits: int) -> list[dict | None]:
    """None = the shipped heuristic; the rest are what --sweep also times."""
    p = 32 * (bits // __import__("math").gcd(bits, 32)) // bits
    out: list[dict | None] = []
    gemv = lambda bn, cpi, xp=True: dict(KIND="gemv", BM=1, BN=bn, T=max(1, cpi // p), num_warps=4,  # noqa: E731
                                         num_stages=1, XPERM=xp)
    mma = lambda bm, bn, cpi, w: dict(KIND="mma", BM=bm, BN=bn, T=max(16, cpi // p), num_warps=w,  # noqa: E731
                                      num_stages=1, XPERM=True)
    tiles = dict(KIND="tiles")  # the previous kernels (generic unpack, tensor-core tiles)
    if m == 1:
        out += [gemv(16, 256, False), gemv(16, 256), gemv(32, 512), tiles]
    elif m <= 4:
        out += [tiles, gemv(32, 512), mma(16, 64, 128, 4)]
    elif m <= 16:
        out += [tiles, mma(16, 128, 128, 4), mma(16, 128, 256, 8)]
    elif m <= 64:
        out += [tiles, mma(64, 128, 128, 8), dict(KIND="cublas", CHUNK_BYTES=96 << 20)]
    elif m <= 256:
        out += [tiles, dict(KIND="cublas", CHUNK_BYTES=96 << 20, OVERLAP=True)]
    else:
        out += [dict(KIND="cublas", CHUNK_BYTES=96 << 20), dict(KIND="cublas", CHUNK_BYTES=192 << 20)]
    uniq, seen = [], set()
    for c in out:
        if cfg_str(c) not in seen:
            seen.add(cfg_str(c))
            uniq.append(c)
    out = uniq
    return out


def cfg_str(cfg: dict | None) -> str:
    if cfg is None:
        return "shipped"
    if cfg["KIND"] == "tiles":
        return "tiles"
    if cfg["KIND"] == "cublas":
        return f"cublas {cfg['CHUNK_BYTES'] >> 20}MB{' overlap' if cfg.get('OVERLAP') else ''}"
    return f"{cfg['KIND']} BN{cfg['BN']} T{cfg['T']} w{cfg['num_warps']}{' xp' if cfg.get('XPERM') else ''}"


def median_time(fn, m: int, runs: int = 3) -> float:
    replays = 100 if m <= 64 else (30 if m <= 256 else 5)
    return statistics.median(graph_time_us(fn, replays) for _ in range(runs))


def marlin_setup(rows: int, cols: int, bits: int, group: int):
    """vLLM's Marlin on a random repacked table (the layout it needs: a second, tiled copy of
    the codes, which the plugin cannot keep beside the lookup's), or None."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        from vllm.scalar_type import scalar_types
    except Exception as exc:  # no vLLM here
        print(f"marlin: vllm does not import ({exc!r})", flush=True)
        return None
    dev = torch.device("cuda")
    qtype = scalar_types.uint4b8 if bits == 4 else scalar_types.uint8b128
    pack = 32 // bits
    qw = torch.randint(-(2**31), 2**31 - 1, (cols // pack, rows), dtype=torch.int32, device=dev)
    empty = torch.empty(0, dtype=torch.int32, device=dev)
    mq = ops.gptq_marlin_repack(qw, empty, cols, rows, bits)
    del qw
    scales = (torch.rand(cols // group, rows, device=dev) * 1e-3 + 1e-3).to(torch.bfloat16)
    ws = marlin_make_workspace_new(dev)

    def run(x):
        return ops.marlin_gemm(x, None, mq, None, scales, None, None, empty, empty, empty, ws, qtype,
                               size_m=x.shape[0], size_n=rows, size_k=cols, is_k_full=True,
                               use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False)

    return run


def bench_table(rows: int, cols: int, sweep: bool, log) -> tuple[str, dict]:
    xs = {m: torch.randn(m, cols, device="cuda").to(torch.bfloat16) for m in MS}
    weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
    bf = {m: median_time(lambda m=m: xs[m] @ weight.T, m) for m in MS}
    del weight
    torch.cuda.empty_cache()
    log(f"[{rows}x{cols}] bf16: " + " ".join(f"M={m}:{bf[m]:.0f}" for m in MS))
    table_rows = [["BF16 cuBLAS"] + [f"{bf[m]:.0f} us" for m in MS] + ["-", "-"]]
    results: dict = {"bf16": bf}
    cfg_rows: list = []
    for name in SHIPPED:
        fmt = FORMATS[name]
        spec = spec_of(fmt, cols)
        packed = random_packed(fmt, rows, cols)
        best: dict = {}
        same_all = True
        for m in MS:
            cands = [c for c in candidates(m, spec.bits) if c is not None] if sweep else [None]
            times = {}
            for cfg in cands:
                fn = lambda cfg=cfg, m=m: triton_linear.linear(fmt, packed, xs[m], cols, config=cfg)  # noqa: E731
                try:
                    times[cfg_str(cfg)] = (graph_time_us(fn, 20 if m <= 256 else 3), cfg)
                except Exception as exc:
                    log(f"  {name} M={m} {cfg_str(cfg)} failed: {exc!r}"[:300])
            if sweep:
                log(f"  {name} M={m} " + " ".join(f"[{k}] {v[0] / bf[m]:.2f}" for k, v in sorted(times.items(), key=lambda kv: kv[1][0])))
            key = min(times, key=lambda k: times[k][0])
            cfg = times[key][1]
            fn = lambda cfg=cfg, m=m: triton_linear.linear(fmt, packed, xs[m], cols, config=cfg)  # noqa: E731
            t = median_time(fn, m)
            first = fn()
            same = all(torch.equal(first, fn()) for _ in range(9))
            del first
            same_all &= same
            best[m] = (t, key, same)
            log(f"  {name} M={m}: {t:.0f} us {t / bf[m]:.2f}x [{key}] same bits {same}")
        part = packed.rows(slice(0, 8192))
        ref = xs[16].float() @ fmt.dequantize(part, cols, torch.bfloat16).float().T
        err = ((triton_linear.linear(fmt, part, xs[16], cols).float() - ref).norm() / ref.norm()).item()
        table_rows.append([label(name)] + [f"{best[m][0]:.0f} us ({best[m][0] / bf[m]:.2f}x)" for m in MS]
                          + [f"{err:.1e}", "yes" if same_all else "**no**"])
        cfg_rows.append([label(name)] + [best[m][1] for m in MS])
        results[name] = best
        del packed, part
        torch.cuda.empty_cache()
    for bits, group, name in ((4, 32, "Marlin uint4b8 g32 (vLLM)"), (8, 64, "Marlin uint8b128 g64 (vLLM)")):
        try:
            run = marlin_setup(rows, cols, bits, group)
            if run is None:
                table_rows.append([name] + ["n/a"] * len(MS) + ["-", "-"])
                continue
            t = {m: median_time(lambda m=m: run(xs[m]), m) for m in MS}
            log(f"  {name}: " + " ".join(f"M={m}:{t[m]:.0f}us/{t[m] / bf[m]:.2f}x" for m in MS))
            table_rows.append([name] + [f"{t[m]:.0f} us ({t[m] / bf[m]:.2f}x)" for m in MS] + ["-", "-"])
            results[name] = t
            del run
            torch.cuda.empty_cache()
        except Exception:
            log(f"  {name} failed:\n{traceback.format_exc()[-800:]}")
            table_rows.append([name] + ["failed"] * len(MS) + ["-", "-"])
    md = md_table(["format"] + [f"M={m}" for m in MS] + ["rel. error", "same bits"], table_rows)
    md += "\n\nKernel per cell:\n\n" + md_table(["format"] + [f"M={m}" for m in MS], cfg_rows)
    return md, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time candidate configs, report the best")
    ap.add_argument("--out", default="")
    ap.add_argument("--tables", default="0,1")
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    tables = [TABLES[int(i)] for i in args.tables.split(",")]
    if not args.no_precompile:
        jobs, seen = [], set()
        for rows, cols in tables:
            for name in SHIPPED:
                bits = spec_of(FORMATS[name], cols).bits
                for m in MS:
                    for cfg in candidates(m, bits) if args.sweep else [None]:
                        eff = cfg or triton_linear.linear_config(m, rows, cols, bits, spec_of(FORMATS[name], cols).fp8)
                        if eff["KIND"] in ("cublas", "tiles"):
                            key = (name, cols, eff["KIND"], m if eff["KIND"] == "tiles" else 0)
                        else:  # the compiled variant: M only matters through the gemv's rows
                            key = (name, cols, cfg_str(eff), min(m, 4) if eff["KIND"] == "gemv" else eff["BM"])
                        if key not in seen:
                            seen.add(key)
                            jobs.append(("linear", FORMATS[name], cols, m, rows, cfg))
        precompile(jobs, workers=14)
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    parts = []
    for rows, cols in tables:
        md, _ = bench_table(rows, cols, args.sweep, log)
        parts.append(f"Table {rows} x {cols}, x and logits in BF16.\n\n{md}\n")
        print(md, flush=True)
    if args.out:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        head = (f"Measured {stamp} on {torch.cuda.get_device_name()} (torch {torch.__version__}), "
                f"`python bench/bench_gemm.py{' --sweep' if args.sweep else ''}`.\n\n")
        with open(args.out, "w") as f:
            f.write(head + "\n".join(parts))
    log("done")


if __name__ == "__main__":
    main()
