"""Tables in the layout of vLLM's Machete GEMM (`formats/machete.py`, `kernels/machete.py`):
the layout against what vLLM's `machete_prepack_B` was measured to do, reads back as the base
format, the setting that picks it; on a Hopper GPU with vLLM (the device), vLLM's own prepack
against the reference, the lookup kernel bit for bit, and `machete_mm` for every size."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from tests.interpreter import run_in_interpreter
from vllm_embed_plugin import kernels
from vllm_embed_plugin.formats import FORMATS, IntFormat, PackedRows, make_format
from vllm_embed_plugin.formats.machete import MacheteLayout, element_offset, unsupported

BASES = [FORMATS["int8"], IntFormat("int4-g64", 4, 64), IntFormat("int4-g128", 4, 128)]

#: Measured on an H200 with vLLM 0.26 (prepacking tensors whose codes are the digits of each
#: entry's position): for each bit of an element's index inside a 128 x 64 block, the
#: (column, row) offset it stands for.
MEASURED_BITS = {
    4: [(0, 8), (8, 0), (1, 0), (16, 0), (32, 0), (2, 0), (4, 0)]
    + [(0, 1), (0, 2), (0, 4), (0, 16), (0, 32), (0, 64)],
    8: [(1, 0), (0, 8), (8, 0), (16, 0), (32, 0), (2, 0), (4, 0)]
    + [(0, 1), (0, 2), (0, 4), (0, 16), (0, 32), (0, 64)],
}


def machete_runs() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        from vllm import _custom_ops  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops._C, "machete_mm")


hopper = pytest.mark.skipif(not machete_runs(), reason="needs a Hopper GPU and vLLM's Machete")


def random_table(fmt, rows, cols, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=g) * 0.02).to(device)
    return fmt.quantize(weight)


def expected_rows(base: IntFormat, packed: PackedRows, cols: int, ids, dtype=torch.bfloat16):
    """The base format's rows with the scales rounded to bfloat16, as Machete stores them."""
    bf16 = PackedRows(codes=packed.codes, scales=packed.scales.to(torch.bfloat16).float())
    return base.dequantize(bf16.rows(ids), cols, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_element_offsets_follow_the_measured_layout(bits):
    padded, cols = 256, 128  # 2 x 2 blocks
    n = torch.arange(padded)[:, None]
    k = torch.arange(cols)[None, :]
    offsets = element_offset(n, k, bits, padded)
    assert torch.equal(offsets.reshape(-1).sort().values, torch.arange(padded * cols))
    # Blocks: column blocks outermost, then row blocks.
    assert offsets[0, 64].item() == 2 * 8192 and offsets[128, 0].item() == 8192
    for bit, (col, row) in enumerate(MEASURED_BITS[bits]):
        assert offsets[row, col].item() == 1 << bit, (bit, col, row)


@pytest.mark.parametrize("base", BASES, ids=lambda f: f.name)
def test_a_machete_table_reads_back_as_its_base_format(base):
    rows, cols = 300, 256  # rows padded to 384
    fmt = MacheteLayout(base)
    packed = random_table(fmt.row_format, rows, cols)
    table = fmt.from_rows(packed, cols)
    assert table.codes.shape == (rows, cols * base.bits // 32)
    assert table.scales.shape == (rows, cols // base.group_size)
    words, scales = fmt.machete_operands(table)
    assert words.is_contiguous() and words.shape == (cols * base.bits // 32, 384)
    assert scales.is_contiguous() and scales.dtype == torch.bfloat16
    pad = element_offset(torch.arange(rows, 384)[:, None], torch.arange(cols), base.bits, 384)
    assert (fmt.codes_at(words, pad) == 1 << (base.bits - 1)).all()  # padding: level 0 (biased)
    ids = torch.tensor([[0, 299, 7], [8, 136, 255]])
    got = kernels.lookup(fmt, table, ids, cols, torch.bfloat16)
    assert torch.equal(got, expected_rows(base, packed, cols, ids.reshape(-1)).view(2, 3, cols))
    x = torch.randn(5, cols).bfloat16()
    want = x @ expected_rows(base, packed, cols, torch.arange(rows)).T
    assert torch.equal(kernels.linear(fmt, table, x, cols), want)


def test_the_format_rounds_against_its_bfloat16_scales_then_repacks():
    base = FORMATS["int8"]
    fmt = MacheteLayout(base)
    weight = torch.randn(1024, 256) * 0.02
    rows_major = fmt.row_format.quantize(weight)
    assert rows_major.scales.dtype == torch.bfloat16
    direct = fmt.quantize(weight)
    assert torch.equal(direct.codes, fmt.from_rows(rows_major, 256).codes)
    assert fmt.bits_per_weight(256) == base.bits_per_weight(256)

    def mse(table):
        return ((fmt.dequantize(table, 256, torch.float32) - weight) ** 2).mean().item()

    # Codes rounded against the bfloat16 scales lose next to nothing to float16 scales;
    # float16 codes under scales merely cast to bfloat16 lose several percent.
    plain = ((base.dequantize(base.quantize(weight), 256, torch.float32) - weight) ** 2).mean()
    assert mse(direct) < 1.01 * plain.item()
    assert mse(fmt.from_rows(base.quantize(weight), 256)) > 1.03 * plain.item()


@pytest.mark.parametrize(
    "fmt, cols, reason",
    [
        (FORMATS["int6"], 256, "not symmetric int4 or int8"),
        (FORMATS["int5"], 256, "not symmetric int4 or int8"),
        (IntFormat("int4a", 4, 64, symmetric=False), 256, "not symmetric int4 or int8"),
        (FORMATS["fp8"], 256, "not symmetric int4 or int8"),
        (FORMATS["int4"], 256, "group size 32"),
        (make_format("int8", "row"), 256, "group size row"),
        (FORMATS["int8"], 640 + 32, "not a multiple of 64"),
        (FORMATS["int8"], 640, None),
        (make_format("int4", 128), 640, None),
    ],
)
def test_what_machete_can_serve(fmt, cols, reason):
    got = unsupported(fmt, cols)
    assert got == reason if reason is None else reason in got


def test_head_kernel_setting_picks_the_layout_and_names_what_is_wrong(monkeypatch):
    from vllm_embed_plugin import layer as layer_module
    from vllm_embed_plugin.settings import EmbedSettingsError, current_settings

    table = dataclasses.make_dataclass("Layer", ["embedding_dim", "params_dtype"])(
        640, torch.bfloat16
    )
    base = FORMATS["int8"]
    for setting in ("auto", "plugin", "machete"):
        monkeypatch.setenv("VLLM_EMBED_HEAD_KERNEL", setting)
        current_settings.cache_clear()
        if setting == "machete" and not machete_runs():
            with pytest.raises(EmbedSettingsError) as info:
                layer_module._head_layout(base, table, "target embed")
            message = str(info.value)
            assert "VLLM_EMBED_HEAD_KERNEL='machete'" in message and "Hopper" in message
            assert "\n" not in message
            continue
        got = layer_module._head_layout(base, table, "target embed")
        use = setting == "machete" or (setting == "auto" and machete_runs())
        assert got == (MacheteLayout(base) if use else base), setting
    monkeypatch.setenv("VLLM_EMBED_HEAD_KERNEL", "machete")
    current_settings.cache_clear()
    with pytest.raises(EmbedSettingsError, match="format 'int6' is not symmetric int4 or int8"):
        layer_module._head_layout(FORMATS["int6"], table, "target embed")


def test_wide_heads_take_wider_machete_tiles_at_middle_sizes(monkeypatch):
    from vllm_embed_plugin.kernels import machete

    fmt = MacheteLayout(FORMATS["int8"])
    wide = dict(machete.WIDE_HEAD_SCHEDULES)
    monkeypatch.setattr(
        machete, "_supported_schedules", lambda bits, dtype: frozenset(wide.values())
    )
    rows, cols = machete.WIDE_HEAD_ROWS, 2560
    sizes = (1, 16, 32, 33, 64, 65, 128, 129, 4096)
    got = {m: machete._schedule(fmt, m, rows, cols) for m in sizes}
    assert got == {
        **dict.fromkeys((1, 16, 32, 129, 4096)),
        **dict.fromkeys((33, 64), wide[64]),
        **dict.fromkeys((65, 128), wide[128]),
    }
    assert machete._schedule(fmt, 64, rows - 128, cols) is None  # a small table: Machete's
    assert machete._schedule(fmt, 64, rows, 4096) is None  # int8 lost there
    assert machete._schedule(MacheteLayout(BASES[1]), 64, rows, 4096) == wide[64]  # int4 won
    monkeypatch.setattr(machete, "_supported_schedules", lambda bits, dtype: frozenset())
    assert machete._schedule(fmt, 64, rows, cols) is None  # a vLLM without that schedule


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from test_machete import BASES, random_table
    from vllm_embed_plugin.formats.machete import MacheteLayout
    from vllm_embed_plugin.kernels import lookup_torch, machete
    for base in BASES:
        fmt = MacheteLayout(base)
        table = fmt.from_rows(random_table(fmt.row_format, 300, 320), 320)
        ids = torch.tensor([[0, 5, 8, 299], [137, 128, 7, 200]])
        # float32 out: the interpreter rounds to bfloat16 by truncation, the GPU to nearest.
        got = machete.lookup(fmt, table, ids, 320, torch.float32)
        want = lookup_torch(fmt, table, ids, 320, torch.float32)
        assert torch.equal(got, want), base.name
    print("ok")
    """
)


@pytest.mark.interpreter
def test_lookup_kernel_in_interpreter():
    run_in_interpreter(INTERPRETER_CHECK, timeout=600)


# -- on a Hopper GPU with vLLM (the device) -----------------------------------------------


@hopper
@pytest.mark.parametrize("base", BASES, ids=lambda f: f.name)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_vllm_prepack_is_the_reference_layout(base, scale_dtype):
    from vllm_embed_plugin.kernels import machete

    fmt = MacheteLayout(base, scale_dtype)
    for rows in (1000, 1024):  # padded, or converted in place
        packed = random_table(fmt.row_format, rows, 640, "cuda")
        want = fmt.from_rows(packed, 640)
        got = machete.repack(fmt, packed)  # consumes packed
        for a, b in zip(fmt.machete_operands(got), fmt.machete_operands(want), strict=True):
            assert torch.equal(a, b), rows


@hopper
@pytest.mark.parametrize("base", BASES, ids=lambda f: f.name)
@pytest.mark.parametrize("cols", [2560, 640])
def test_gpu_lookup_kernel_is_the_reference_bit_for_bit(base, cols):
    from vllm_embed_plugin.kernels import machete

    fmt = MacheteLayout(base)
    rows = 3000  # padded to 3072
    table = machete.repack(fmt, random_table(fmt.row_format, rows, cols, "cuda"))
    for n in (0, 1, 7, 64, 300, 5000):
        ids = torch.randint(0, rows, (n,), device="cuda")
        if n:
            ids[-1] = rows - 1
        got = machete.lookup(fmt, table, ids, cols, torch.bfloat16)
        assert torch.equal(got, kernels.lookup_torch(fmt, table, ids, cols, torch.bfloat16)), n
    ids = torch.randint(0, rows, (4, 9), device="cuda")
    assert machete.lookup(fmt, table, ids, cols, torch.float32).shape == (4, 9, cols)


@hopper
@pytest.mark.parametrize("base", BASES, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [3000, 4096, 40000])  # 40000: wide-head schedules
def test_gpu_machete_logits_are_right_and_deterministic(base, rows):
    from vllm_embed_plugin.kernels import machete

    fmt, cols = MacheteLayout(base), 2560
    table = machete.repack(fmt, random_table(fmt.row_format, rows, cols, "cuda"))
    weight = fmt.dequantize(table, cols, torch.float32)
    for m in (1, 2, 16, 64, 65, 128, 256, 300, 4096):
        x = torch.randn(m, cols, device="cuda").bfloat16()
        out = machete.linear(fmt, table, x, cols)
        assert out.shape == (m, rows) and out.dtype == torch.bfloat16
        ref = x.float() @ weight.T
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, m
        for _ in range(10):
            assert torch.equal(out, machete.linear(fmt, table, x, cols)), m
