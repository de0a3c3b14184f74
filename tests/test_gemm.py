"""The tied-head GEMM's kernels (`kernels/triton_linear.py`): every kind (CUDA-core GEMV,
word kernels on CUDA cores for several rows, word tiles on
tensor cores, the generic tiles, dequantize-and-cuBLAS, the generic fallback) against the reference, in
Triton's interpreter on the CPU and on a GPU (skipped without CUDA); the same inputs give the
same bits every call."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.interpreter import run_in_interpreter
from vllm_embed_plugin.convert import quantize_table
from vllm_embed_plugin.formats import FORMATS, Fp8Format, IntFormat

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: The shipped formats plus widths and group sizes that take other branches (a block that
#: spans groups: int5 g16, int6 g8; per-row scales; int3, int2).
VARIANTS = [FORMATS[n] for n in ("int8", "int6", "int5", "int4", "fp8")] + [
    IntFormat("int8-row", 8, None),
    IntFormat("int6-row", 6, None),
    IntFormat("int6-g8", 6, 8),
    IntFormat("int5-g16", 5, 16),
    IntFormat("int4-affine-g64", 4, 64, symmetric=False),
    IntFormat("int3-g32", 3, 32),
    IntFormat("int2-affine-row", 2, None, symmetric=False),
    Fp8Format("fp8-g32", 32),
]

KINDS = [
    None,  # the heuristic
    dict(KIND="gemv", BM=1, BN=16, T=4, num_warps=1, num_stages=1),
    dict(KIND="gemv", BM=1, BN=16, T=4, num_warps=1, num_stages=1, SPLIT_K=3, MAGIC=False),
    dict(KIND="mma", BM=16, BN=16, T=16, num_warps=1, num_stages=1),
    dict(KIND="mma", BM=16, BN=32, T=16, num_warps=1, num_stages=1, SPLIT_K=2),
    dict(KIND="cublas", CHUNK_BYTES=1 << 10),
    dict(KIND="gemv", BM=1, BN=16, T=16, num_warps=1, num_stages=1, XPERM=True),
    dict(KIND="mma", BM=16, BN=32, T=16, num_warps=1, num_stages=1, XPERM=True),
    dict(KIND="tiles"),
    dict(KIND="rows", BM=4, BN=16, T=4, num_warps=1, num_stages=1, XPERM=True),
    dict(KIND="rows", BM=8, BN=16, T=2, num_warps=1, num_stages=1, SPLIT_K=3),
    dict(KIND="wdot", BM=16, BN=16, T=8, num_warps=1, num_stages=1),
    dict(KIND="wdot", BM=16, BN=16, T=4, num_warps=1, num_stages=1, SPLIT_K=2),
    dict(KIND="wdot", BM=16, BN=16, T=8, num_warps=1, num_stages=1, GPOST=True),
    dict(KIND="wdot", BM=16, BN=16, T=8, num_warps=1, num_stages=1, SWAP=False),
]


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from test_gemm import KINDS, VARIANTS
    from vllm_embed_plugin.convert import quantize_table
    from vllm_embed_plugin.kernels import triton_linear
    torch.manual_seed(0)
    for cols in (256, 104):  # 104: not a whole number of blocks for most widths (fallback)
        w = torch.randn(40, cols) * 0.02
        for fmt in VARIANTS:
            t = quantize_table(w, fmt)
            wd = fmt.dequantize(t, cols, torch.float16).float()
            # KINDS[0] is the heuristic: at M = 1 here, and again at 4 and 40 (its M <= 16 and
            # M <= 64 choices) at the end.
            ms = (1, 3, 1, 5, 20, 7, 4, 6, 9, 3, 11, 17, 5, 6, 2, 4, 40)
            for m, cfg in zip(ms, KINDS + [None, None]):
                x = torch.randn(m, cols).half()  # fp16: the interpreter's bf16 dot is not exact
                ref = x.float() @ wd.T
                out = triton_linear.linear(fmt, t, x, cols, config=cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert out.shape == (m, 40) and err < 2e-3, (fmt.name, cols, m, cfg, err)
                assert torch.equal(out, triton_linear.linear(fmt, t, x, cols, config=cfg))
    print("ok")
    """
)


def test_an_explicit_config_replaces_the_heuristic(monkeypatch):
    """A config passed in is used as given: merged into the heuristic's choice, a sweep's
    candidate inherited flags (SWAP, GPOST) it did not name and was timed under a wrong
    label."""
    from vllm_embed_plugin.kernels import triton_linear

    fmt, cols = FORMATS["int8"], 256
    table = quantize_table(torch.randn(40, cols) * 0.02, fmt)
    seen = []
    monkeypatch.setattr(
        triton_linear, "linear_words", lambda *args: seen.append(dict(args[-1])) or args[-2]
    )
    x = torch.randn(4, cols).half()
    assert triton_linear.linear_config(4, 40, cols, 8).get("GPOST")  # the heuristic's flag
    triton_linear.linear(fmt, table, x, cols)
    plain = dict(KIND="wdot", BM=16, BN=64, T=32, num_warps=4, num_stages=3)
    triton_linear.linear(fmt, table, x, cols, config=plain)
    assert seen == [triton_linear.linear_config(4, 40, cols, 8), plain]


@pytest.mark.parametrize(
    "m, bits, fp8, kind, bm, swap",
    [
        (64, 8, False, "wdot", 64, False),
        (100, 8, False, "wdot", 128, False),
        (100, 8, True, "wdot", 128, False),
        (100, 4, False, "tiles", None, None),
        (200, 8, False, "wdot", 256, True),
        (256, 4, False, "wdot", 256, True),
        (256, 8, True, "wdot", 256, False),
        (128, 6, False, "tiles", None, None),
        (129, 5, False, "tiles", 256, False),
        (256, 6, False, "tiles", None, None),
        (257, 8, False, "cublas", None, None),
    ],
)
def test_batched_sizes_take_the_swept_kernels(m, bits, fp8, kind, bm, swap):
    """M = 65..256: int8, int4 and fp8 decode each weight once for up to 256 rows of x (x on
    the left up to 128; W on the left above, int8 and int4); int5/int6 the generic tiles
    reading their two planes as words, int5 in one tile of 256 rows above 128; larger M takes
    the cuBLAS chunks (docs/BENCHMARKS.md)."""
    from vllm_embed_plugin.kernels.triton_linear import linear_config

    cfg = linear_config(m, 262144, 2560, bits, fp8)
    assert cfg["KIND"] == kind
    if bm is not None:
        assert cfg["BM"] == bm and cfg.get("SWAP", True) is swap and cfg["BM"] >= m


@pytest.mark.interpreter
def test_gemm_kernels_in_interpreter():
    run_in_interpreter(INTERPRETER_CHECK, timeout=1200)


PACKED_CHECK = textwrap.dedent(
    """
    import torch
    from vllm_embed_plugin.convert import quantize_table
    from vllm_embed_plugin.formats import FORMATS, IntFormat
    from vllm_embed_plugin.kernels import triton_linear

    def no_fallback(*args):
        raise AssertionError("PACK fell back to the generic kernels")

    triton_linear.linear_tiles = no_fallback
    torch.manual_seed(0)
    w = torch.randn(40, 256) * 0.02
    formats = [FORMATS["int4"], IntFormat("a", 4, 64, symmetric=False), IntFormat("r", 4, None)]
    for fmt in formats:
        t = quantize_table(w, fmt)
        wd = fmt.dequantize(t, 256, torch.float32)
        raw = dict(GPOST=True) if fmt.group_size else {}
        for m, bm, tt in ((1, 16, 8), (5, 16, 16), (20, 32, 8)):
            cfg = dict(KIND="wdot", BM=bm, BN=16, T=tt, num_warps=1, num_stages=1, PACK=True, **raw)
            x = torch.randn(m, 256).half()
            out = triton_linear.linear(fmt, t, x, 256, config=cfg)
            ref = x.float() @ wd.T
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-3, (fmt.name, m, cfg, err)
    print("ok")
    """
)


WORDS_CHECK = textwrap.dedent(
    """
    import torch
    from vllm_embed_plugin.convert import quantize_table
    from vllm_embed_plugin.formats import FORMATS, IntFormat
    from vllm_embed_plugin.kernels import triton_linear

    torch.manual_seed(0)
    formats = [FORMATS["int4"], IntFormat("g64", 4, 64), IntFormat("row", 4, None),
               IntFormat("affine", 4, 32, symmetric=False), FORMATS["int5"], FORMATS["int6"],
               IntFormat("int5-sym", 5, 32), IntFormat("int6-row", 6, None),
               IntFormat("int6-affine-row", 6, None, symmetric=False)]
    for cols in (256, 104):  # 104: no whole tile, the chunk path
        w = torch.randn(40, cols) * 0.02
        for fmt in formats:
            t = quantize_table(w, fmt)
            wd = fmt.dequantize(t, cols, torch.float32)
            for m in (1, 3, 20, 100):  # the GEMV, a padded tile, the small and the large tile
                x = torch.randn(m, cols).half()
                ref = x.float() @ wd.T
                plain = triton_linear.linear(fmt, t, x, cols, config=dict(KIND="tiles"))
                out = triton_linear.linear(fmt, t, x, cols, config=dict(KIND="tiles", WORDS=True))
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert out.shape == (m, 40) and err < 2e-3, (fmt.name, cols, m, err)
                assert ((out.float() - plain.float()).norm() / ref.norm()).item() < 2e-3
    print("ok")
    """
)


@pytest.mark.interpreter
def test_word_tiles_in_interpreter():
    """The generic tiles reading codes as words (`WORDS`: 4-bit codes, and the two planes of
    5- and 6-bit codes; symmetric, affine, per group and per row), with the plain decode in
    place of the PTX: right against float32 and level with the byte tiles, x's columns
    reordered as the tile's (`word_order`); it fails (relative error near 1) if the two
    orders part."""
    run_in_interpreter(WORDS_CHECK, timeout=600)


def test_word_order_is_the_operand_order():
    """`word_order`: x's column 8 q + 4 b + m (code m + 4 b of word q) at 8 m + 2 q + b within
    every 32 columns, as the word tiles leave their levels; zero rows pad."""
    from vllm_embed_plugin.kernels.gemm_tiles import word_order

    x = torch.arange(128.0).reshape(2, 64)
    out = word_order(x, True, 3)
    order = [(h, m, q, b) for h in range(2) for m in range(4) for q in range(4) for b in range(2)]
    want = [32 * h + 8 * q + 4 * b + m for h, m, q, b in order]
    assert out[0].tolist() == want and out[1].tolist() == [64 + c for c in want]
    assert out[2].eq(0).all() and word_order(x, False, 2) is x


@pytest.mark.interpreter
def test_packed_nibble_tiles_in_interpreter():
    """PACK's tile and x in wgmma's column order, with the plain decode in place of the PTX: right
    against float32 for symmetric, affine and per-row 4-bit formats."""
    run_in_interpreter(PACKED_CHECK, timeout=600)


def test_pack_leaves_groups_of_2_words_to_the_generic_kernels():
    """PACK orders columns 4 words at a time: a dot per group of 2 words (int4 g16) takes
    the generic kernels (None), before any launch."""
    from vllm_embed_plugin.kernels.gemm_words import linear_words, words_of
    from vllm_embed_plugin.kernels.triton_lookup import spec_of

    fmt = IntFormat("g16", 4, 16)
    table = quantize_table(torch.randn(64, 256), fmt)
    spec = spec_of(fmt, 256)
    cfg = dict(KIND="wdot", BM=16, BN=16, T=8, num_warps=1, num_stages=1, GPOST=True, PACK=True)
    x = torch.randn(1, 256).half()
    out = torch.empty(1, 64, dtype=x.dtype)
    assert linear_words(spec, table, words_of(table, spec, 256), x, 256, out, cfg) is None


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32` (default mode): byte i of the result is byte (selector >> 4 i) & 7 of
    b:a (a's bytes 0-3, then b's)."""
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> 4 * i) & 7] for i in range(4)), "little")


def _run_nibble_ptx(ptx: str, word: int, high: int = 0, *scales: int) -> list[float]:
    """The instructions `nibble_asm` emits, executed on one word, its chunk's high bits ($9)
    and the scaled form's packed scale operands ($10, $11): its 8 outputs."""
    dt = torch.bfloat16 if ".bf16x2" in ptx else torch.float16

    def half(bits: int) -> float:
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dt).float().item()

    def bits_of(v: float) -> int:
        return torch.tensor([v]).to(dt).view(torch.int16).item() & 0xFFFF

    regs, outs = {"$8": word, "$9": high, **{f"${10 + i}": v for i, v in enumerate(scales)}}, {}
    body = ptx.strip().removeprefix("{").removesuffix("}")
    for line in filter(None, (x.strip() for x in body.split(";"))):
        op, rest = line.split(" ", 1)
        if op == ".reg":
            continue
        if rest.startswith("{"):  # mov.b32 {lo, hi}, src
            lo, hi = (x.strip() for x in rest[1 : rest.index("}")].split(","))
            src = regs[rest.split("}")[1].strip(" ,")]
            outs[lo], outs[hi] = src & 0xFFFF, src >> 16
            continue
        d, *args = (x.strip() for x in rest.split(","))
        v = [regs[a] if a in regs else int(a, 0) for a in args]
        if op == "mov.b32":
            regs[d] = v[0]
        elif op == "shr.u32":
            regs[d] = v[0] >> v[1]
        elif op == "shl.b32":
            regs[d] = v[0] << v[1] & 0xFFFFFFFF
        elif op == "and.b32":
            regs[d] = v[0] & v[1]
        elif op == "mul.lo.u32":
            regs[d] = v[0] * v[1] & 0xFFFFFFFF
        elif op == "prmt.b32":
            regs[d] = _prmt(*v)
        elif op == "lop3.b32":
            assert v[3] == 0x6A  # (a & b) ^ c
            regs[d] = (v[0] & v[1]) ^ v[2]
        else:
            assert op in ("fma.rn.bf16x2", "fma.rn.f16x2"), op
            regs[d] = sum(
                bits_of(
                    half(v[0] >> k & 0xFFFF) * half(v[1] >> k & 0xFFFF) + half(v[2] >> k & 0xFFFF)
                )
                << k
                for k in (0, 16)
            )
    if not outs:  # float32 outputs
        return [
            torch.tensor([regs[f"${j}"]], dtype=torch.int64)
            .to(torch.int32)
            .view(torch.float32)
            .item()
            for j in range(8)
        ]
    return [half(outs[f"${j}"]) for j in range(8)]


def _codes(word: int, high: int, bits: int) -> list[int]:
    """A chunk's 8 codes: nibble J of the word, high bits (bits - 4 of them) J of `high`."""
    hb = bits - 4
    return [(word >> 4 * j & 15) | (high >> hb * j & ((1 << hb) - 1)) << 4 for j in range(8)]


def _chunks(bits: int, seed: int) -> list[tuple[int, int]]:
    """Words and high fields that put every code in every position, and random ones."""
    g = torch.Generator().manual_seed(seed)
    hb = bits - 4
    ones = (1 << 8 * hb) - 1
    edges = [(0x76543210, 0), (0x89ABCDEF, ones), (0xFFFFFFFF, ones), (0, 0), (0xFFFFFFFF, 0)]
    edges += [(0x76543210 ^ (0x11111111 * k), (0x55555555 * k) & ones) for k in range(16)]
    rand = torch.randint(0, 2**32, (40, 2), generator=g, dtype=torch.int64).tolist()
    return edges + [(w, h & ones) for w, h in rand]


@pytest.mark.parametrize("dt", ["bf16", "fp16", "bf16 f32"])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("bits", [4, 5, 6])
def test_packed_nibble_decode_gives_every_level(dt, signed, bits):
    """The PTX that decodes codes two per instruction (run on a GPU only), executed
    instruction by instruction here: every 4-bit code, and every 5- and 6-bit code from its
    two planes, in every position, gives its level (as 16-bit floats, or float32)."""
    from vllm_embed_plugin.kernels.nibbles import nibble_asm

    ptx = nibble_asm(dt.split()[0], signed, high=bits - 4, f32=dt.endswith("f32"))
    half = 1 << bits - 1
    for word, high in _chunks(bits, 0):
        levels = [c - 2 * half if signed and c >= half else c for c in _codes(word, high, bits)]
        assert _run_nibble_ptx(ptx, word, high) == levels, (hex(word), hex(high))


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 5, 6])
def test_scaled_nibble_decode_rounds_as_the_reference(dt, bits):
    """The words tile's PTX (`nibble_asm(..., scaled=True)`), executed here: every two's
    complement code in every position, times fp16 group scales of every magnitude (subnormal
    to large, awkward mantissas), comes out exactly as the reference rounds level * scale
    (float32 product, one rounding to the 16-bit dtype): bf16 through its s_hi + s_lo split."""
    from vllm_embed_plugin.kernels.nibbles import nibble_asm

    ptx = nibble_asm(dt, True, scaled=True, high=bits - 4)
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([2.0**-24, 3 * 2.0**-24, 2.0**-14, 1, 1 + 2.0**-10, 1.9990234375, 6e4])
    scales = torch.cat([edges, torch.exp(torch.randn(30, generator=g) * 4).clamp(max=6e4)])
    scales = scales.half().float()
    half = 1 << bits - 1

    def pair(v: torch.Tensor) -> int:
        b = v.reshape(1).view(torch.int16).item() & 0xFFFF
        return b | b << 16

    for s in scales:
        hi = s.to(torch.bfloat16)
        ops = (
            [pair(hi), pair((s - hi.float()).to(torch.bfloat16))]
            if dt == "bf16"
            else [pair(s.half())]
        )
        for word, high in _chunks(bits, 2)[:24]:
            levels = torch.tensor([(c ^ half) - half for c in _codes(word, high, bits)])
            want = (levels.float() * s).to(dtype).float().tolist()
            assert _run_nibble_ptx(ptx, word, high, *ops) == want, (hex(word), s.item())


@cuda
@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
@pytest.mark.parametrize("cols", [2560, 576, 100])
def test_gpu_gemm_every_size_is_right_and_deterministic(fmt, cols):
    from vllm_embed_plugin.kernels import triton_linear

    rows = 3000
    g = torch.Generator().manual_seed(1)
    table = quantize_table((torch.randn(rows, cols, generator=g) * 0.02).cuda(), fmt)
    wd = fmt.dequantize(table, cols, torch.bfloat16).float()
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 40, 64, 65, 128, 200, 300):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        out = triton_linear.linear(fmt, table, x, cols)
        assert out.shape == (m, rows) and out.dtype == torch.bfloat16
        assert not out.isnan().any()
        assert rel_err(out, x.float() @ wd.T) < 1e-2, m
        for _ in range(3):
            assert torch.equal(out, triton_linear.linear(fmt, table, x, cols)), m
    x = torch.randn(6, cols, device="cuda").to(torch.bfloat16)
    ref = x.float() @ wd.T
    for cfg in KINDS[1:] + [dict(KIND="cublas", CHUNK_BYTES=1 << 20, OVERLAP=True)]:
        out = triton_linear.linear(fmt, table, x, cols, config=cfg)
        assert rel_err(out, ref) < 1e-2, cfg
        assert torch.equal(out, triton_linear.linear(fmt, table, x, cols, config=cfg)), cfg


#: W on the left with every row of x in one tile: the tiles the dispatch gives int8 and int4
#: at M = 129-256 (docs/BENCHMARKS.md), checked here with explicit configs, so a later route
#: change leaves them tested.
WIDE_W_LEFT = [
    ("int8", dict(KIND="wdot", BM=256, BN=128, T=16, num_warps=8, num_stages=4)),
    ("int4", dict(KIND="wdot", BM=256, BN=64, T=8, num_warps=4, num_stages=3)),
]


@cuda
@pytest.mark.parametrize("name, cfg", WIDE_W_LEFT, ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("rows, cols", [(131072, 2560), (65536, 4096)])
def test_gpu_w_on_the_left_tiles_are_right_and_deterministic(name, cfg, rows, cols):
    """The M = 129-256 candidates: right against float32 and the same bits over 5 calls at
    every M they would serve, on two widths."""
    from vllm_embed_plugin.kernels import triton_linear

    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    table = quantize_table((torch.randn(rows, cols, generator=g) * 0.02).cuda(), fmt)
    wd = fmt.dequantize(table, cols, torch.float32)
    for m in (129, 160, 200, 256):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        out = triton_linear.linear(fmt, table, x, cols, config=cfg)
        assert rel_err(out, x.float() @ wd.T) < 1e-2, m
        for _ in range(5):
            assert torch.equal(out, triton_linear.linear(fmt, table, x, cols, config=cfg)), m


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "fmt",
    [
        FORMATS["int4"],
        IntFormat("int4-affine-g64", 4, 64, symmetric=False),
        IntFormat("int4-row", 4, None),
    ],
    ids=lambda f: f.name,
)
def test_gpu_packed_nibbles_are_right_and_deterministic(fmt, dtype, monkeypatch):
    """'wdot' with PACK (4-bit levels decoded two per instruction by inline PTX): right against
    the float32 reference at every M, in both 16-bit dtypes, the same bits every call."""
    from vllm_embed_plugin.kernels import triton_linear

    def no_fallback(*args):
        raise AssertionError("PACK fell back to the generic kernels")

    monkeypatch.setattr(triton_linear, "linear_tiles", no_fallback)
    rows, cols = 3000, 2560
    g = torch.Generator().manual_seed(2)
    table = quantize_table((torch.randn(rows, cols, generator=g) * 0.02).cuda(), fmt)
    wd = fmt.dequantize(table, cols, torch.float32)
    raw = dict(GPOST=True) if fmt.group_size else {}
    configs = [
        dict(KIND="wdot", BM=bm, BN=bn, T=16, num_warps=4, num_stages=3, PACK=True, **raw)
        for bm, bn in ((16, 64), (64, 128), (128, 64))
    ]
    for m in (1, 5, 16, 40, 64, 200):
        x = torch.randn(m, cols, device="cuda").to(dtype)
        ref = x.float() @ wd.T
        for cfg in configs:
            out = triton_linear.linear(fmt, table, x, cols, config=cfg)
            assert out.dtype == dtype and rel_err(out, ref) < 2e-3, (m, cfg)
            assert torch.equal(out, triton_linear.linear(fmt, table, x, cols, config=cfg)), (m, cfg)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "fmt",
    [FORMATS[n] for n in ("int4", "int5", "int6")]
    + [IntFormat("int4-row", 4, None), IntFormat("int4-affine", 4, 32, symmetric=False)]
    + [IntFormat("int5-sym", 5, 32), IntFormat("int6-row", 6, None)],
    ids=lambda f: f.name,
)
def test_gpu_word_tiles_are_right_and_deterministic(fmt, dtype):
    """The generic tiles with WORDS (codes as words, levels and scales two per packed
    instruction): right against float32 at every M each tile shape serves, in both 16-bit
    dtypes, the same bits every call, and level with the byte tiles."""
    from vllm_embed_plugin.kernels import triton_linear

    rows, cols = 3000, 2560
    g = torch.Generator().manual_seed(4)
    table = quantize_table((torch.randn(rows, cols, generator=g) * 0.02).cuda(), fmt)
    wd = fmt.dequantize(table, cols, dtype).float()  # the weights as the reference rounds them
    words, plain = dict(KIND="tiles", WORDS=True), dict(KIND="tiles")
    for m in (1, 2, 5, 16, 17, 40, 64, 65, 128, 200):
        x = torch.randn(m, cols, device="cuda").to(dtype)
        ref = x.float() @ wd.T
        out = triton_linear.linear(fmt, table, x, cols, config=words)
        assert out.dtype == dtype and rel_err(out, ref) < 2e-3, m
        assert rel_err(out, triton_linear.linear(fmt, table, x, cols, config=plain)) < 2e-3, m
        for _ in range(3):
            assert torch.equal(out, triton_linear.linear(fmt, table, x, cols, config=words)), m


@cuda
@pytest.mark.parametrize(
    "cfg",
    [
        None,
        dict(KIND="cublas", CHUNK_BYTES=1 << 20, OVERLAP=True),
        dict(KIND="gemv", BM=1, BN=16, T=16, num_warps=4, num_stages=1, SPLIT_K=4),
    ],
    ids=["default", "cublas-overlap", "gemv-split"],
)
def test_gpu_gemm_in_a_cuda_graph(cfg):
    from vllm_embed_plugin.kernels import triton_linear

    fmt = FORMATS["int5"]
    rows, cols = 5000, 2560
    table = quantize_table((torch.randn(rows, cols) * 0.02).cuda(), fmt)
    wd = fmt.dequantize(table, cols, torch.bfloat16).float()
    for m in (1, 16, 300):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        eager = triton_linear.linear(fmt, table, x, cols, config=cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_linear.linear(fmt, table, x, cols, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), m
        x.copy_(torch.randn(m, cols, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.float() @ wd.T) < 1e-2, m


def test_the_dispatch_table_in_the_docs_is_the_code():
    """docs/BENCHMARKS.md shows `triton_linear.ROUTES` as `bench_gemm.py --dispatch` prints it."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_gemm", root / "bench/bench_gemm.py")
        bench_gemm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_gemm)
    finally:
        sys.path.remove(str(root / "bench"))
    doc = (root / "docs/BENCHMARKS.md").read_text()
    start = doc.index("<!-- dispatch table: bench/bench_gemm.py --dispatch -->\n")
    end = doc.index("\n<!-- end of dispatch table -->")
    assert doc[start:end].split("\n", 1)[1] == bench_gemm.dispatch_markdown()


def test_every_format_and_m_has_a_route():
    """The dispatch answers every M with a known kernel; M = 1 takes the word kernel, or for
    the two-plane widths (5, 6 bits), which the word kernels do not read, the generic tiles
    reading them as words (x padded to 16 rows)."""
    from vllm_embed_plugin.kernels.triton_linear import linear_config

    for bits, fp8 in ((4, False), (5, False), (6, False), (8, False), (8, True)):
        one_row = "tiles" if bits in (5, 6) else "gemv"
        assert linear_config(1, 1000, 2560, bits, fp8)["KIND"] == one_row
        assert linear_config(1, 1000, 2560, bits, fp8).get("WORDS", False) is (bits in (5, 6))
        for m in (2, 16, 17, 64, 65, 128, 129, 200, 256, 257, 4096):
            assert linear_config(m, 1000, 2560, bits, fp8)["KIND"] in ("wdot", "tiles", "cublas")
