"""Tied-head GEMM on the GPU: logits [M, rows] = x [M, cols] @ dequant(W)^T, every shipped
format against BF16 cuBLAS and vLLM's Marlin and Machete in the same process (no vLLM needed,
except for those anchors, skipped when `vllm._C` does not import).

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
import re
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import (  # noqa: E402
    gpu_target,
    graph_time_us,
    md_table,
    median_time,
    precompile,
    random_packed,
)

from vllm_embed_plugin.formats import FORMATS  # noqa: E402
from vllm_embed_plugin.formats.integer import high_bits  # noqa: E402
from vllm_embed_plugin.kernels import triton_linear  # noqa: E402
from vllm_embed_plugin.kernels.triton_lookup import spec_of  # noqa: E402

TABLES = [(262144, 2560), (151936, 4096)]
MS = [1, 2, 4, 8, 16, 64, 128, 256, 4096]
SHIPPED = ["int8", "int6", "int5", "int4", "fp8"]
WIDE = False  # --wide: a larger grid of word-tile candidates
VARIANTS = ""  # --variants: a regular expression the swept variants' names must match


def label(name: str) -> str:
    fmt = FORMATS[name]
    g = getattr(fmt, "group_size", None)
    kind = "" if getattr(fmt, "symmetric", True) else " affine"
    return f"{name}{kind} {'per-row' if g is None else f'g{g}'}"


def candidates(m: int, bits: int) -> list[dict | None]:
    """None = the shipped heuristic; the rest are what --sweep also times."""
    p = 32 * (bits // __import__("math").gcd(bits, 32)) // bits
    out: list[dict | None] = [None]
    gemv = lambda bn, cpi, xp=True: dict(
        KIND="gemv",
        BM=1,
        BN=bn,
        T=max(1, cpi // p),
        num_warps=4,
        num_stages=1,
        XPERM=xp,
    )
    rows = lambda bm, bn, cpi, xp=True: dict(
        KIND="rows",
        BM=bm,
        BN=bn,
        T=max(1, cpi // p),
        num_warps=4,
        num_stages=1,
        XPERM=xp,
    )
    wdot = lambda bm, bn, cpt, w, st=1: dict(
        KIND="wdot",
        BM=bm,
        BN=bn,
        T=max(1, cpt // p),
        num_warps=w,
        num_stages=st,
    )
    mma = lambda bm, bn, cpi, w: dict(
        KIND="mma",
        BM=bm,
        BN=bn,
        T=max(16, cpi // p),
        num_warps=w,
        num_stages=1,
        XPERM=True,
    )
    tiles = dict(KIND="tiles")  # the generic kernels (chunk unpack, tensor-core tiles)
    if high_bits(bits):  # two planes: the word kernels do not read them
        # FAST off: the lookup's chunk decoder (a nibble word and a high field per 8 values).
        extra = [tiles, dict(tiles, MAGIC=False), dict(tiles, FAST=False)]
        return _unique(out + extra + planes_candidates(m) + words_candidates(m))
    if WIDE and 1 < m <= 256:
        bm = 16 if m <= 16 else (64 if m <= 64 else 128)
        grid = [(bn, cpt, 4, st) for bn in (32, 64, 128) for cpt in (128, 256) for st in (3, 4)]
        grid += [(128, cpt, 8, 3) for cpt in (128, 256)]
        if m > 16:
            grid = [(bn, cpt, w, st) for bn, cpt, w, st in grid if bn >= 64 and cpt == 128] + [
                (256, 64, 8, 3),
                (128, 64, 8, 3),
            ]
        out += [wdot(bm, bn, cpt, w, st) for bn, cpt, w, st in grid]
        out += [
            dict(wdot(64 if m <= 64 else 128, bn, cpt, w, st), SWAP=False)
            for bn, cpt, w, st in ((64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3))
        ]
    if m == 1:
        out += [gemv(16, 256, False), gemv(16, 256), gemv(32, 512), tiles]
    elif m <= 16:
        out += [
            tiles,
            wdot(16, 128, 128, 4, 3),
            wdot(16, 128, 128, 4),
            wdot(16, 64, 128, 4, 3),
            dict(wdot(16, 128, 128, 4, 3), GPOST=True),
            dict(wdot(16, 64, 128, 4, 3), GPOST=True),
        ]
        if m == 2:
            out += [rows(2, 32, 256)]
        # one dot per piece of 16 blocks, x permuted
        out += [mma(16, 64, 16 * p, 4), mma(16, 128, 16 * p, 4)]
    elif m <= 64:
        out += [
            tiles,
            dict(wdot(64, 128, 128, 4, 3), SWAP=False),
            dict(wdot(64, 128, 128, 4), SWAP=False),
            wdot(64, 64, 128, 4),
            wdot(64, 128, 128, 4),
            wdot(64, 64, 128, 4, 3),
            dict(wdot(64, 128, 128, 4, 3), GPOST=True),
            dict(KIND="cublas", CHUNK_BYTES=96 << 20),
        ]
    elif m <= 256:
        out += [
            tiles,
            dict(wdot(128, 128, 128, 4, 3), SWAP=False),
            dict(wdot(128, 128, 64, 8, 3), SWAP=False),
            dict(KIND="cublas", CHUNK_BYTES=96 << 20, OVERLAP=True),
        ]
        # x on the left; 256 rows: each weight decoded once.
        out += [
            dict(wdot(128, 256, 64, 8, 3), SWAP=False),
            dict(wdot(128, 128, 32, 8, 4), SWAP=False),
            dict(wdot(256, 64, 64, 8, 3), SWAP=False),
            dict(wdot(256, 64, 64, 8, 4), SWAP=False),
            dict(wdot(256, 64, 128, 8, 3), SWAP=False),
            dict(wdot(256, 32, 64, 4, 3), SWAP=False),
            dict(wdot(256, 64, 64, 4, 3), SWAP=False),
            dict(wdot(256, 128, 64, 8, 3), SWAP=False),
        ]
        # W on the left with every row of x in one tile: the decoded weights stay in registers
        # as the first operand of Hopper's wgmma, which can then overlap the next tile's decode.
        out += [wdot(256, 128, 64, 8, st) for st in (2, 3, 4)]
        out += [wdot(256, 64, 64, 4, 3), wdot(128, 128, 64, 8, 3)]
    else:
        out += [
            dict(KIND="cublas", CHUNK_BYTES=96 << 20),
            dict(KIND="cublas", CHUNK_BYTES=192 << 20),
        ]
    if bits == 4 and m <= 256:  # raw levels decoded two per instruction, scaled per group after
        # More rows a thread spreads the loop's fixed cost: on sm_90, 5.0 instructions a weight
        # at BN = 64 on 4 warps, 3.6 at BN = 128, 2.9 at BN = 256 (bench/kernel_sass.py).
        shapes = [(16, bn, 128, 4, 3) for bn in (64, 128, 256)] + [(16, 128, 256, 4, 3)]
        if m > 16:
            shapes = [(64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3)]
        if m > 64:
            shapes = [(128, 128, 128, 8, 3), (128, 64, 128, 4, 3)]
        out += [dict(wdot(*shape), GPOST=True, PACK=True) for shape in shapes]
    if tiles in out:  # levels through the int->float unit, as before the magic-number trick
        out.append(dict(tiles, MAGIC=False))
    if bits == 4 and m <= 256:
        out += words_candidates(m)
    return _unique(out)


def words_candidates(m: int) -> list[dict]:
    """The generic tiles reading codes as words (`WORDS`: levels and scales two per packed
    instruction): the shipped shapes, and beside them shapes whose tensor-core products
    Triton overlaps with the next decode on sm_90 (`bench/kernel_sass.py` shows `wait 1`
    for some shapes and formats and `wait 0` for others, with no pattern found). At M = 1 the
    tensor-core tile of M <= 16 (x padded to 16 rows), which the cheaper decode may carry past
    the GEMV."""
    tile = lambda *shape, **kw: dict(triton_linear.tiles_shape(*shape, **kw), WORDS=True)
    if m == 1:  # the shipped M = 1 kernels are GEMVs, which read no words
        return [tile(16, 64, 128, 4, 4), tile(16, 64, 256, 4, 3)]
    if m <= 16:
        shapes = [tile(16, 64, 256, 4, 3), tile(16, 128, 128, 4, 3)]
    elif m <= 64:
        shapes = [tile(64, 64, 256, 4, 3), tile(64, 128, 128, 8, 3)]
    else:
        shapes = [tile(128, 128, 128, 8, 3, swap=False), tile(64, 64, 256, 4, 3)]
    if m > 128:  # every row of x in one tile: each weight decoded once (6.4 a weight, int4)
        shapes += [tile(256, 128, 64, 8, 2, swap=False), tile(256, 64, 64, 8, 3, swap=False)]
    return [dict(KIND="tiles", WORDS=True)] + shapes


def planes_candidates(m: int) -> list[dict]:
    """5- and 6-bit codes (a nibble plane and a high plane) in the generic tiles: shapes
    around the shipped ones (`gemm_tiles.tiles_config`), and cuBLAS on dequantized rows."""
    tile = triton_linear.tiles_shape
    if m == 1:
        return [
            dict(KIND="tiles", GEMV=True, BN=bn, BK=bk, num_warps=w, num_stages=1)
            for bn in (16, 32)
            for bk in (128, 256)
            for w in (2, 4)
        ]
    if m <= 16:
        return [
            tile(16, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for st in (2, 4)
        ]
    out = [tile(64, bn, bk, 4, st) for bn in (64, 128) for bk in (64, 128) for st in (3, 4)]
    if m > 64:
        out += [
            tile(128, 128, 64, 8, 3, False),
            tile(128, 256, 64, 8, 4, False),
            tile(128, 128, 128, 8, 3, False),
            tile(64, 128, 128, 8, 3, False),
        ]
    return out + [dict(KIND="cublas", CHUNK_BYTES=96 << 20, OVERLAP=True)]


def _unique(out: list) -> list:
    """The candidates in order, each once, and only those --variants selects."""
    uniq, seen = [], set()
    for c in out:
        if c is not None and VARIANTS and not re.search(VARIANTS, cfg_str(c)):
            continue
        if cfg_str(c) not in seen:
            seen.add(cfg_str(c))
            uniq.append(c)
    return uniq


#: Variants whose compile failed in `precompile`: not run here, as Triton may abort on them.
FAILED: set = set()


def variant_key(name: str, rows: int, cols: int, m: int, cfg: dict | None) -> tuple:
    """What one compiled variant is told apart by: M matters only through the tile of rows."""
    fmt = FORMATS[name]
    spec = spec_of(fmt, cols)
    eff = cfg or triton_linear.linear_config(m, rows, cols, spec.bits, spec.fp8)
    if eff["KIND"] in ("cublas", "tiles"):
        return (
            name,
            cols,
            cfg_str(cfg) if cfg else eff["KIND"],
            m if eff["KIND"] == "tiles" else 0,
        )
    tile = min(m, eff["BM"]) if eff["KIND"] in ("gemv", "rows") else eff["BM"]
    return (name, cols, cfg_str(eff), tile)


#: The generic tiles' flags a variant's name shows, when set to the value given here.
TILE_FLAGS = (("MAGIC", False, " i2f"), ("FAST", False, " chunks"), ("WORDS", True, " words"))


def cfg_str(cfg: dict | None) -> str:
    if cfg is None:
        return "shipped"
    if cfg["KIND"] == "tiles":
        for key, value, suffix in TILE_FLAGS:
            if key in cfg and cfg[key] == value:
                return cfg_str({k: v for k, v in cfg.items() if k != key}) + suffix
        if "BN" not in cfg:
            return "tiles"
        if cfg.get("GEMV"):
            return f"tiles gemv BN{cfg['BN']} BK{cfg['BK']} w{cfg['num_warps']}"
        swap = "" if cfg.get("SWAP", True) else "noswap "
        return (
            f"tiles {swap}BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} w{cfg['num_warps']}"
            f" s{cfg['num_stages']}"
        )
    if cfg["KIND"] == "cublas":
        return f"cublas {cfg['CHUNK_BYTES'] >> 20}MB{' overlap' if cfg.get('OVERLAP') else ''}"
    bm = f"BM{cfg['BM']} " if cfg["KIND"] in ("rows", "wdot") else ""
    st = f" s{cfg['num_stages']}" if cfg.get("num_stages", 1) > 1 else ""
    if cfg.get("SWAP") is False:
        bm = "noswap " + bm
    if cfg.get("GPOST"):
        bm = "gpost " + bm
    if cfg.get("PACK"):
        bm = "pack " + bm
    return f"{cfg['KIND']} {bm}BN{cfg['BN']} T{cfg['T']} w{cfg['num_warps']}{st}{' xp' if cfg.get('XPERM') else ''}"


def random_gptq(rows: int, cols: int, bits: int, group: int, device: str = "cuda"):
    """vLLM's scalar type for symmetric `bits`-bit codes (uint4b8, uint8b128), random codes
    GPTQ-packed along the hidden size [cols * bits / 32, rows] int32, and BF16 group scales
    [cols / group, rows]: the inputs the anchors repack."""
    from vllm.scalar_type import scalar_types

    qtype = scalar_types.uint4b8 if bits == 4 else scalar_types.uint8b128
    qw = torch.randint(
        -(2**31), 2**31 - 1, (cols * bits // 32, rows), dtype=torch.int32, device=device
    )
    scales = (torch.rand(cols // group, rows, device=device) * 1e-3 + 1e-3).to(torch.bfloat16)
    return qtype, qw, scales


def marlin_setup(rows: int, cols: int, bits: int, group: int):
    """vLLM's Marlin on a random repacked table (the layout it needs: a second, tiled copy of
    the codes, which the plugin cannot keep beside the lookup's), or None."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_workspace_new,
        )
    except Exception as exc:  # no vLLM here
        print(f"marlin: vllm does not import ({exc!r})", flush=True)
        return None
    qtype, qw, scales = random_gptq(rows, cols, bits, group)
    empty = torch.empty(0, dtype=torch.int32, device=qw.device)
    mq = ops.gptq_marlin_repack(qw, empty, cols, rows, bits)
    del qw
    ws = marlin_make_workspace_new(mq.device)

    def run(x):
        return ops.marlin_gemm(
            x,
            None,
            mq,
            None,
            scales,
            None,
            None,
            empty,
            empty,
            empty,
            ws,
            qtype,
            size_m=x.shape[0],
            size_n=rows,
            size_k=cols,
            is_k_full=True,
            use_atomic_add=False,
            use_fp32_reduce=True,
            is_zp_float=False,
        )

    return run


def machete_setup(rows: int, cols: int, bits: int, group: int):
    """vLLM's Machete (Hopper, CUTLASS) on a random prepacked table, or None. Like Marlin it
    needs its own copy of the codes (`machete_prepack_B`); group sizes 64 and 128 only."""
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # no vLLM here
        print(f"machete: vllm does not import ({exc!r})", flush=True)
        return None
    qtype, qw, scales = random_gptq(rows, cols, bits, group)
    mq = ops.machete_prepack_B(qw.t().contiguous().t(), torch.bfloat16, qtype, torch.bfloat16)
    del qw

    def run(x):
        return ops.machete_mm(a=x, b_q=mq, b_type=qtype, b_group_scales=scales, b_group_size=group)

    return run


def cell(t: float, bf: float, tgt: float | None, mark: str = "") -> str:
    s = f"{t:.0f} us ({t / bf:.2f}x){mark}"
    return f"**{s}**" if tgt is not None and t / bf > tgt + 0.005 else s


def bench_table(
    rows: int, cols: int, sweep: bool, log, ms=None, names=None, anchor=True
) -> tuple[str, dict]:
    ms = ms or MS
    names = SHIPPED if names is None else names
    xs = {m: torch.randn(m, cols, device="cuda").to(torch.bfloat16) for m in ms}
    weight = (torch.randn(rows, cols, device="cuda") * 0.02).to(torch.bfloat16)
    bf = {m: median_time(lambda m=m: xs[m] @ weight.T, m) for m in ms}
    del weight
    torch.cuda.empty_cache()
    log(f"[{rows}x{cols}] bf16: " + " ".join(f"M={m}:{bf[m]:.0f}" for m in ms))
    table_rows = [["BF16 cuBLAS"] + [f"{bf[m]:.0f} us" for m in ms]]
    results: dict = {"bf16": bf}
    cfg_rows: list = []
    notes: list = []
    for name in names:
        fmt = FORMATS[name]
        spec = spec_of(fmt, cols)
        packed = random_packed(fmt, rows, cols)
        best: dict = {}
        same_all = True
        for m in ms:
            shipped = triton_linear.linear_config(m, rows, cols, spec.bits, spec.fp8)
            key = cfg_str(shipped)
            mark = ""
            if sweep:
                times = {}
                want = triton_linear.linear(fmt, packed, xs[m], cols).float()
                for cfg in candidates(m, spec.bits):
                    if variant_key(name, rows, cols, m, cfg) in FAILED:
                        log(f"  {name} M={m} {cfg_str(cfg)} failed to compile")
                        continue
                    fn = lambda cfg=cfg, m=m: triton_linear.linear(
                        fmt, packed, xs[m], cols, config=cfg
                    )
                    try:
                        off = (fn().float() - want).norm() / want.norm()
                        if off > 1e-2:  # a variant that computes something else is no candidate
                            log(f"  {name} M={m} {cfg_str(cfg)} wrong: {off:.1e} off the shipped")
                            continue
                        times[cfg_str(cfg if cfg is not None else shipped)] = graph_time_us(
                            fn, 20 if m <= 256 else 3
                        )
                    except Exception as exc:
                        log(f"  {name} M={m} {cfg_str(cfg)} failed: {exc!r}"[:300])
                del want
                log(
                    f"  {name} M={m} "
                    + " ".join(
                        f"[{k}] {v / bf[m]:.2f}"
                        for k, v in sorted(times.items(), key=lambda kv: kv[1])
                    )
                )
                fastest = min(times, key=times.get)
                if key in times and fastest != key and times[fastest] < 0.95 * times[key]:
                    mark = "†"
                    notes.append(
                        f"{label(name)} M={m}: {fastest} {times[fastest] / bf[m]:.2f}x in the sweep "
                        f"(shipped {key}: {times[key] / bf[m]:.2f}x)"
                    )
            fn = lambda m=m: triton_linear.linear(fmt, packed, xs[m], cols)
            t = median_time(fn, m)
            first = fn()
            same = all(torch.equal(first, fn()) for _ in range(9))
            del first
            same_all &= same
            best[m] = (t, key, same)
            log(f"  {name} M={m}: {t:.0f} us {t / bf[m]:.2f}x [{key}] same bits {same}")
            cfg_rows_cell = key + ("" if same else " (**bits differ**)")
            best[m] = (t, cfg_rows_cell, same, mark)
        part = packed.rows(slice(0, 8192))
        m_err = 16 if 16 in xs else ms[-1]
        ref = xs[m_err].float() @ fmt.dequantize(part, cols, torch.bfloat16).float().T
        err = (
            (triton_linear.linear(fmt, part, xs[m_err], cols).float() - ref).norm() / ref.norm()
        ).item()
        log(
            f"  {name}: rel. error {err:.1e} (M={m_err}), same bits over 10 calls at every M: {same_all}"
        )
        table_rows.append(
            [label(name)] + [cell(best[m][0], bf[m], gpu_target(name, m), best[m][3]) for m in ms]
        )
        cfg_rows.append([label(name)] + [best[m][1] for m in ms])
        results[name] = best
        results.setdefault("errors", {})[name] = (err, same_all)
        del packed, part
        torch.cuda.empty_cache()
    for setup, bits, group, name in (
        (marlin_setup, 4, 32, "Marlin uint4b8 g32 (vLLM), anchor"),
        (marlin_setup, 8, 64, "Marlin uint8b128 g64 (vLLM), anchor"),
        (machete_setup, 4, 64, "Machete uint4b8 g64 (vLLM), anchor"),
        (machete_setup, 8, 64, "Machete uint8b128 g64 (vLLM), anchor"),
    ):
        if not anchor:
            break
        try:
            run = setup(rows, cols, bits, group)
            if run is None:
                table_rows.append([name] + ["n/a"] * len(ms))
                continue
            t = {m: median_time(lambda m=m: run(xs[m]), m) for m in ms}
            log(f"  {name}: " + " ".join(f"M={m}:{t[m]:.0f}us/{t[m] / bf[m]:.2f}x" for m in ms))
            table_rows.append([name] + [f"{t[m]:.0f} us ({t[m] / bf[m]:.2f}x)" for m in ms])
            results[name] = t
            del run
            torch.cuda.empty_cache()
        except Exception:
            log(f"  {name} failed:\n{traceback.format_exc()[-800:]}")
            table_rows.append([name] + ["failed"] * len(ms))
    md = (
        f"**{rows} x {cols}** (ratio to BF16 cuBLAS in the same run; bold = misses its target)\n\n"
        + md_table(["format"] + [f"M={m}" for m in ms], table_rows)
    )
    if cfg_rows:
        md += "\n\nKernel per cell (shipped heuristic):\n\n" + md_table(
            ["format"] + [f"M={m}" for m in ms], cfg_rows
        )
    if notes:
        md += "\n\n† faster in the sweep than the shipped choice:\n\n" + "\n".join(
            f"- {n}" for n in notes
        )
    return md, results


def dispatch_markdown() -> str:
    """`triton_linear.ROUTES` as the Markdown table docs/BENCHMARKS.md shows (a test keeps the
    two equal): one line per route, first match wins."""
    lines = [
        "| # | M up to | formats | kernel | shape | why (H200 sweep, ratio to BF16 cuBLAS) |",
        "|---|---|---|---|---|---|",
    ]
    for i, route in enumerate(triton_linear.ROUTES, 1):
        cfg = route.config
        shape = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "KIND")
        if route.tile:
            shape += f", T={route.tile}/P"
        formats = ", ".join(route.formats)
        if route.min_cols:
            formats += f" (rows of {route.min_cols}+)"
        lines.append(
            f"| {i} | {route.max_m} | {formats} | {cfg['KIND']} | {shape or '-'} | {route.why} |"
        )
    lines.append(
        f"| {len(triton_linear.ROUTES) + 1} | any | all | cublas | CHUNK_BYTES=96 MiB, "
        "OVERLAP at M <= 1024 | the rest: compute-bound, cuBLAS on dequantized chunks |"
    )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dispatch",
        action="store_true",
        help="print the M dispatch (triton_linear.ROUTES) as Markdown and exit; no GPU",
    )
    ap.add_argument(
        "--sweep", action="store_true", help="also time candidate configs, report the best"
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--tables", default="0,1")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="batch sizes")
    ap.add_argument(
        "--formats", default=",".join(SHIPPED), help="'none': only BF16 and the anchors"
    )
    ap.add_argument("--no-anchor", action="store_true", help="skip vLLM's Marlin and Machete")
    ap.add_argument("--wide", action="store_true", help="a larger grid of word-tile candidates")
    ap.add_argument(
        "--variants", default="", help="--sweep: only variants whose name matches this regex"
    )
    args = ap.parse_args()
    if args.dispatch:
        print(dispatch_markdown())
        return 0
    global WIDE, VARIANTS
    WIDE, VARIANTS = args.wide, args.variants
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    tables = [TABLES[int(i)] for i in args.tables.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    names = [] if args.formats == "none" else args.formats.split(",")
    if not args.no_precompile:
        jobs: dict = {}  # variant key -> its compile job, one per variant
        for rows, cols in tables:
            for name in names:
                bits = spec_of(FORMATS[name], cols).bits
                for m in ms:
                    for cfg in candidates(m, bits) if args.sweep else [None]:
                        key = variant_key(name, rows, cols, m, cfg)
                        jobs.setdefault(key, ("linear", FORMATS[name], cols, m, rows, cfg))
        ok = precompile(list(jobs.values()), workers=14)
        FAILED.update(key for key, good in zip(jobs, ok) if not good)
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    parts = []
    for rows, cols in tables:
        md, _ = bench_table(rows, cols, args.sweep, log, ms, names, not args.no_anchor)
        parts.append(md + "\n")
        print(md, flush=True)
    if args.out:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        head = (
            f"Measured {stamp} on {torch.cuda.get_device_name()} (torch {torch.__version__}), "
            f"`python bench/bench_gemm.py{' --sweep' if args.sweep else ''}`.\n\n"
        )
        with open(args.out, "w") as f:
            f.write(head + "\n".join(parts))
    log("done")


if __name__ == "__main__":
    main()
