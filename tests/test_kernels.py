"""Lookup and tied-head matmul: the torch paths against the format reference (CPU, CI), the
Triton kernels through Triton's interpreter (CPU, when Triton is installed), and the Triton
kernels on a GPU (skipped without CUDA).

Tolerances: lookups and the 8-bit conversion are bit-exact against the reference on the same
device. The GEMM accumulates in float32 in another order than the reference's matmul and
rounds once to bf16: relative error (Frobenius) under 1e-2, measured about 2e-3.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import run_in_interpreter
from vllm_embed_plugin import kernels
from vllm_embed_plugin.convert import quantize_table
from vllm_embed_plugin.formats import Fp8Format, IntFormat

VARIANTS = [
    IntFormat("int8-row", 8, None),
    IntFormat("int8-g32", 8, 32),
    IntFormat("int8-g64", 8, 64),
    IntFormat("int8-affine-g32", 8, 32, symmetric=False),
    IntFormat("int6-row", 6, None),
    IntFormat("int6-g64", 6, 64),
    IntFormat("int5-affine-g32", 5, 32, symmetric=False),
    IntFormat("int4-g32", 4, 32),
    IntFormat("int4-affine-g32", 4, 32, symmetric=False),
    IntFormat("int4-affine-g64", 4, 64, symmetric=False),
    IntFormat("int4-g128", 4, 128),
    IntFormat("int3-g16", 3, 16),
    IntFormat("int2-affine-row", 2, None, symmetric=False),
    Fp8Format("fp8-row", None),
    Fp8Format("fp8-g32", 32),
]
# (rows, cols): 576 with group 128 leaves a half group; 100 is not a multiple of 8.
SHAPES = [(97, 576), (41, 100)]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def table_for(fmt, rows, cols, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=g) * 0.02).to(device)
    return quantize_table(weight, fmt)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# -- CPU: torch paths ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lookup_torch_path(fmt, shape):
    rows, cols = shape
    table = table_for(fmt, rows, cols)
    ids = torch.randint(0, rows, (3, 5))
    out = kernels.lookup(fmt, table, ids, cols, torch.bfloat16)
    assert out.shape == (3, 5, cols) and out.dtype == torch.bfloat16
    ref = fmt.dequantize(table.rows(ids.reshape(-1)), cols, torch.bfloat16).view(3, 5, cols)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 12])
def test_linear_torch_path(fmt, shape, m):
    rows, cols = shape
    table = table_for(fmt, rows, cols)
    x = torch.randn(m, cols).to(torch.bfloat16)
    ref = x.float() @ fmt.dequantize(table, cols, torch.bfloat16).float().T
    out = kernels.linear(fmt, table, x, cols)
    assert out.shape == (m, rows) and out.dtype == torch.bfloat16
    # int8 per row at m <= 8 goes through _weight_int8pack_mm with bf16 scales.
    assert rel_err(out, ref) < 1e-2


def test_linear_torch_path_chunks_and_batch_dims():
    fmt = IntFormat("int4-g32", 4, 32)
    rows, cols = 203, 96
    table = table_for(fmt, rows, cols)
    x = torch.randn(2, 3, cols)
    ref = x @ fmt.dequantize(table, cols, torch.float32).T
    # 1 KiB of scratch -> one row per chunk: every chunk boundary is exercised.
    out = kernels.linear_torch(fmt, table, x, cols, chunk_bytes=1024)
    assert out.shape == (2, 3, rows)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.linear(fmt, table, x, cols), ref, rtol=1e-5, atol=1e-6)


def test_linear_int8_rows_use_weight_int8pack_mm(monkeypatch):
    fmt = IntFormat("int8", 8, None)
    table = table_for(fmt, 64, 128)
    x = torch.randn(4, 128).to(torch.bfloat16)
    calls = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(1) or real(*a))
    out = kernels.linear(fmt, table, x, 128)
    assert calls, "per-row int8 at decode size should use _weight_int8pack_mm"
    ref = x.float() @ fmt.dequantize(table, 128, torch.float32).T
    assert rel_err(out, ref) < 1e-2
    calls.clear()
    kernels.linear(fmt, table, torch.randn(9, 128).to(torch.bfloat16), 128)
    assert not calls, "9 rows and more take the chunked path"


def test_identity_format_is_a_plain_gather_and_matmul():
    from vllm_embed_plugin.formats import IdentityFormat

    fmt = IdentityFormat("host")
    table = quantize_table((torch.randn(30, 64) * 0.02).to(torch.bfloat16), fmt)
    ids = torch.randint(0, 30, (2, 4))
    assert torch.equal(kernels.lookup(fmt, table, ids, 64, torch.bfloat16), table.codes[ids])
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert rel_err(kernels.linear(fmt, table, x, 64), x.float() @ table.codes.float().T) < 1e-2


def test_package_imports_and_runs_without_triton():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("no triton here")
        sys.meta_path.insert(0, Block())
        import torch
        from vllm_embed_plugin import kernels
        from vllm_embed_plugin.convert import quantize_table
        from vllm_embed_plugin.formats import IntFormat
        fmt = IntFormat("int8", 8, 32)
        t = quantize_table(torch.randn(10, 64), fmt)
        out = kernels.lookup(fmt, t, torch.tensor([1, 2]), 64, torch.float32)
        assert torch.equal(out, fmt.dequantize(t.rows(torch.tensor([1, 2])), 64, torch.float32))
        assert kernels._triton_module("triton_lookup") is None
        assert "triton" not in sys.modules
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# -- CPU: the Triton kernels in Triton's interpreter -------------------------------------------

INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from vllm_embed_plugin.convert import quantize_table
    from vllm_embed_plugin.formats import Fp8Format, IntFormat
    from vllm_embed_plugin.kernels import triton_linear, triton_lookup, triton_quantize
    torch.manual_seed(0)
    fmts = [IntFormat("i8", 8, None), IntFormat("i6", 6, 64), IntFormat("i5a", 5, 32, symmetric=False),
            IntFormat("i4", 4, 32), IntFormat("i4r", 4, 128), IntFormat("i3", 3, 16), Fp8Format("f8", 32)]
    for cols in (576, 100):
        w = torch.randn(40, cols) * 0.02
        ids = torch.randint(0, 40, (2, 9))
        for fmt in fmts:
            t = quantize_table(w, fmt)
            for cfg in ((2, 16, 1), (4, 8, 1), None):
                out = triton_lookup.lookup(fmt, t, ids, cols, torch.float32, config=cfg)
                ref = fmt.dequantize(t.rows(ids.reshape(-1)), cols, torch.float32).view(2, 9, cols)
                assert torch.equal(out, ref), (fmt.name, cols, cfg)
            # The interpreter rounds float32 -> bf16 by truncation: compare within 1 bf16 ulp.
            out = triton_lookup.lookup(fmt, t, ids, cols, torch.bfloat16)
            torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=0)
            # fp16 (the interpreter's bf16 dot is not exact): tiles, split-K, masks.
            x = torch.randn(5, cols).half()
            lref = x.float() @ fmt.dequantize(t, cols, torch.float16).float().T
            for cfg in (None, dict(SPLIT_K=3), dict(BM=16, BN=16, BK=64, SWAP=False, num_warps=1, num_stages=1)):
                out = triton_linear.linear(fmt, t, x, cols, config=cfg)
                err = ((out.float() - lref).norm() / lref.norm()).item()
                assert err < 2e-3, (fmt.name, cols, cfg, err)
        for fmt in (IntFormat("q", 8, None), IntFormat("q", 8, 32)):
            x = (torch.randn(13, cols) * 0.02).to(torch.bfloat16)
            x[2] = 0
            ref, out = fmt.quantize(x), triton_quantize.quantize_rows_fast(fmt, x)
            assert torch.equal(ref.codes, out.codes) and torch.equal(ref.scales, out.scales)
    # GPTQ's group kernel on blocks of columns visited most important first, so that one
    # block mixes the scales of several groups.
    from vllm_embed_plugin.formats import ColumnImportance
    from vllm_embed_plugin.formats.integer import round_jointly
    from vllm_embed_plugin.kernels import triton_joint
    h = torch.randn(400, 96)
    h[:, 70] += 20.0
    joint = ColumnImportance.from_second_moment(h.T @ h / 400, joint=True)
    assert joint.order[0] == 70
    v = torch.randn(50, 96) * 0.02
    for bits, symmetric, group in ((8, True, 32), (4, False, 32), (5, False, 64)):
        packed = IntFormat("q", bits, group, symmetric=symmetric).quantize(v)
        mins = None if packed.mins is None else packed.mins.float()
        args = (v, packed.scales.float(), mins, joint.inverse_factor, group, bits, symmetric)
        fast = round_jointly(*args, round_group=triton_joint.round_group_jointly, order=joint.order)
        assert (fast == round_jointly(*args, order=joint.order)).float().mean() > 0.99, bits
    print("ok")
    """
)


@pytest.mark.interpreter
def test_triton_kernels_in_interpreter():
    run_in_interpreter(INTERPRETER_CHECK, timeout=900)


# -- GPU: Triton kernels against the reference -------------------------------------------------


def _check_lookup(fmt, table, ids, cols, dtype, config=None):
    from vllm_embed_plugin.kernels import triton_lookup

    n = ids.numel()
    poison = torch.full((n, cols), float("nan"), device="cuda", dtype=dtype)
    del poison  # the output most likely reuses this block: anything unwritten stays NaN
    out = triton_lookup.lookup(fmt, table, ids, cols, dtype, config=config)
    ref = fmt.dequantize(table.rows(ids.reshape(-1).long()), cols, dtype).view(*ids.shape, cols)
    assert torch.equal(out, ref), (tuple(ids.shape), ids.dtype, dtype, config)


@cuda
@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 5120), (300, 2560)], ids=str)
def test_gpu_lookup_bit_exact(fmt, shape):
    rows, cols = shape
    table = table_for(fmt, rows, cols, device="cuda")
    for n in (1, 3000):  # the heuristics' small- and large-batch tilings
        _check_lookup(fmt, table, torch.randint(0, rows, (n,), device="cuda"), cols, torch.bfloat16)
    empty = kernels.lookup(
        fmt, table, torch.zeros(0, 4, dtype=torch.long, device="cuda"), cols, torch.bfloat16
    )
    assert empty.shape == (0, 4, cols)
    assert kernels.lookup(
        fmt, table, torch.ones(3, dtype=torch.long, device="cuda"), cols, torch.bfloat16
    ).is_cuda
    if shape != SHAPES[0]:
        return
    # Output dtypes, int32 ids, batch dimensions, and tilings the heuristics may not pick.
    ids = torch.randint(0, rows, (2, 333), device="cuda")
    _check_lookup(fmt, table, ids.int(), cols, torch.float32)
    _check_lookup(fmt, table, ids, cols, torch.float16)
    for cfg in ((1, 8, 1), (4, 32, 2), (16, 16, 4)):
        _check_lookup(fmt, table, ids, cols, torch.bfloat16, config=cfg)


@cuda
@pytest.mark.parametrize(
    "fmt", [VARIANTS[0], VARIANTS[7], VARIANTS[6], VARIANTS[12]], ids=lambda f: f.name
)
def test_gpu_lookup_cuda_graph(fmt):
    rows, cols = 500, 2560
    table = table_for(fmt, rows, cols, device="cuda")
    ids = torch.randint(0, rows, (64,), device="cuda")
    kernels.lookup(fmt, table, ids, cols, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.lookup(fmt, table, ids, cols, torch.bfloat16)
    for _ in range(3):
        ids.copy_(torch.randint(0, rows, (64,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fmt.dequantize(table.rows(ids), cols, torch.bfloat16))


@cuda
@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(97, 576), (41, 100), (3000, 2560)], ids=str)
def test_gpu_linear(fmt, shape):
    rows, cols = shape
    table = table_for(fmt, rows, cols, device="cuda")
    w = fmt.dequantize(table, cols, torch.bfloat16).float()
    for m in (1, 3, 16, 40, 300) if shape == (3000, 2560) else (2, 5, 70):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        out = kernels.linear(fmt, table, x, cols)
        assert out.shape == (m, rows) and out.dtype == torch.bfloat16
        assert not out.isnan().any()
        assert rel_err(out, x.float() @ w.T) < 1e-2, m


@cuda
def test_gpu_linear_split_k_and_graph():
    from vllm_embed_plugin.kernels import triton_linear

    fmt = IntFormat("int4-g32", 4, 32)
    rows, cols = 1000, 2560
    table = table_for(fmt, rows, cols, device="cuda")
    x = torch.randn(3, cols, device="cuda").to(torch.bfloat16)
    ref = x.float() @ fmt.dequantize(table, cols, torch.bfloat16).float().T
    assert rel_err(triton_linear.linear(fmt, table, x, cols, config=dict(SPLIT_K=4)), ref) < 1e-2
    kernels.linear(fmt, table, x, cols)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear(fmt, table, x, cols)
    x.copy_(torch.randn(3, cols, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ref = x.float() @ fmt.dequantize(table, cols, torch.bfloat16).float().T
    assert rel_err(out, ref) < 1e-2


@cuda
@pytest.mark.parametrize(
    "fmt",
    [
        IntFormat("i8", 8, None),
        IntFormat("i8", 8, 32),
        IntFormat("i8", 8, 128),
        IntFormat("i8a", 8, 64, symmetric=False),
        IntFormat("i8a", 8, None, symmetric=False),
        Fp8Format("f8", None),
        Fp8Format("f8", 32),
    ],
    ids=lambda f: f"{f.name}-{f.group_size}",
)
@pytest.mark.parametrize("cols", [576, 100, 5120])
def test_gpu_quantize_fast_bit_exact(fmt, cols):
    x = (torch.randn(300, cols, device="cuda") * 0.02).to(torch.bfloat16)
    x[5] = 0
    x[6, 3] = -x[6].float().abs().max() * 1.5  # a negative largest value
    x[7, 1], x[7, 2] = 0.5, -0.5  # a tie in magnitude: the first one wins
    out = kernels.quantize_rows_fast(fmt, x)
    ref = fmt.quantize(x)
    for name, t in ref.tensors().items():
        assert torch.equal(getattr(out, name).view(torch.uint8), t.view(torch.uint8)), name


@cuda
def test_gpu_quantize_fast_rejects_nan_and_unknown_formats():
    from vllm_embed_plugin.formats import ConversionError

    x = torch.randn(50, 64, device="cuda")
    x[17, 3] = float("inf")
    with pytest.raises(ConversionError, match="row 17"):
        kernels.quantize_rows_fast(IntFormat("i8", 8, None), x)
    assert kernels.quantize_rows_fast(IntFormat("i4", 4, 32), x) is None
    # Straight into pinned host storage (host placement), through CUDA views of it.
    fmt = IntFormat("i8", 8, None)
    x = (torch.randn(70, 576, device="cuda") * 0.02).to(torch.bfloat16)
    out = fmt.empty(70, 576, "cpu").map(lambda t: t.pin_memory())
    got = kernels.quantize_rows_fast(fmt, x, out=out)
    torch.cuda.synchronize()
    assert got is out
    ref = fmt.quantize(x)
    assert torch.equal(out.codes, ref.codes.cpu()) and torch.equal(out.scales, ref.scales.cpu())
    assert kernels.quantize_rows_fast(IntFormat("i8", 8, 32, search=2), x) is None


@cuda
def test_gpu_host_view_is_zero_copy_exact_and_capturable():
    from vllm_embed_plugin.kernels.host import cuda_view_of_pinned

    table = (torch.randn(1000, 640) * 0.02).to(torch.bfloat16).pin_memory()
    view = cuda_view_of_pinned(table)
    assert view.is_cuda and view.data_ptr() == table.data_ptr() and view.dtype == torch.bfloat16
    ids = torch.randint(0, 1000, (77,), device="cuda")
    assert torch.equal(F.embedding(ids, view).cpu(), F.embedding(ids.cpu(), table))
    graph = torch.cuda.CUDAGraph()
    F.embedding(ids, view)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = F.embedding(ids, view)
    table[ids.cpu()] = 1.0  # the view reads the host memory as it is at replay time
    graph.replay()
    torch.cuda.synchronize()
    assert (out == 1.0).all()
    # The fused kernel reads a host-resident int8 table through the same kind of view.
    fmt = IntFormat("int8", 8, None)
    packed = quantize_table(torch.randn(1000, 640) * 0.02, fmt)
    host = packed.map(lambda t: cuda_view_of_pinned(t.pin_memory()))
    out = kernels.lookup(fmt, host, ids, 640, torch.bfloat16)
    assert torch.equal(out.cpu(), fmt.dequantize(packed.rows(ids.cpu()), 640, torch.bfloat16))


@cuda
@pytest.mark.parametrize(
    "bits, symmetric, group", [(8, True, 64), (5, False, 32), (4, False, 64), (4, True, 128)]
)
def test_gpu_joint_rounding_follows_the_torch_loop(bits, symmetric, group):
    """The Triton group kernel does what the torch loop does: the same levels, but for rare
    values where a fused multiply-add moves a carried error across a rounding boundary."""
    from vllm_embed_plugin.formats import ColumnImportance
    from vllm_embed_plugin.formats.integer import round_group_jointly_torch, round_jointly

    gen = torch.Generator().manual_seed(bits)
    cols, rows = 320, 3000
    h = torch.randn(4 * cols, 16, generator=gen) @ torch.randn(16, cols, generator=gen)
    h += torch.randn(4 * cols, cols, generator=gen)
    factor = ColumnImportance.from_second_moment(
        h.T @ h / h.shape[0], joint=True
    ).inverse_factor.cuda()
    values = (torch.randn(rows, cols, generator=gen) * 0.02).cuda()
    fmt = IntFormat("x", bits, group, symmetric=symmetric)
    packed = fmt.quantize(values)  # plain scales: any fixed scales will do
    scales = packed.scales.float()
    mins = None if packed.mins is None else packed.mins.float()
    fast = round_jointly(
        values,
        scales,
        mins,
        factor,
        group,
        bits,
        symmetric,
        round_group=kernels.round_group_jointly_fast,
    )
    step = scales[:, :1].expand(rows, group).contiguous()
    low = torch.zeros_like(step) if mins is None else mins[:, :1].expand(rows, group).contiguous()
    # Whole groups: compare the first group exactly as the loop computes it.
    ref_levels, ref_carried = round_group_jointly_torch(
        values[:, :group], step, low, factor[:group, :group], bits, symmetric
    )
    assert (fast[:, :group] == ref_levels).float().mean() > 0.999
    # And the whole table, through every group's carried errors, against the loop on the CPU.
    cpu = round_jointly(
        values.cpu(),
        scales.cpu(),
        None if mins is None else mins.cpu(),
        factor.cpu(),
        group,
        bits,
        symmetric,
    )
    assert (fast.cpu() == cpu).float().mean() > 0.99
