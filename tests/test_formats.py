import pytest
import torch

from vllm_embed_plugin import convert
from vllm_embed_plugin.convert import quantize_table
from vllm_embed_plugin.formats import (
    FORMATS,
    ColumnImportance,
    ConversionError,
    Fp8Format,
    IntFormat,
    make_format,
)
from vllm_embed_plugin.formats.integer import pack_bits, unpack_bits

VARIANTS = [
    IntFormat("int8-row", 8, None),
    IntFormat("int8-g32", 8, 32),
    IntFormat("int6-row", 6, None),
    IntFormat("int6-g64", 6, 64, search=3),
    IntFormat("int5-affine", 5, 32, symmetric=False, search=3),
    IntFormat("int4-g32", 4, 32),
    IntFormat("int4-affine-g128", 4, 128, symmetric=False),
    Fp8Format("fp8-row", None),
    Fp8Format("fp8-g32", 32),
]


def gaussian_rows(rows=64, cols=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("signed", [True, False])
def test_pack_unpack_roundtrip(bits, signed):
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    levels = torch.randint(low, high, (7, 37))
    packed = pack_bits(levels, bits)
    assert packed.shape == (7, 5 * bits)  # ceil(37 / 8) = 5 groups of 8 values
    assert torch.equal(unpack_bits(packed, bits, 37, signed), levels.int())


def test_four_bit_layout_is_low_nibble_first():
    packed = pack_bits(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 4)
    assert packed.tolist() == [[0x21, 0x43, 0x65, 0x07]]


@pytest.mark.parametrize("bits, high_bytes", [(6, [0b11100100, 0b00011011]), (5, [0b01010101])])
def test_five_and_six_bit_rows_are_a_nibble_plane_then_a_high_plane(bits, high_bytes):
    """The low 4 bits of every code, stored as 4-bit codes are, then the high bits as a bit
    stream (value j of 8 at bit (bits - 4) * j): kernels read both planes as aligned words."""
    high = [0, 1, 2, 3, 3, 2, 1, 0] if bits == 6 else [1, 0] * 4
    levels = torch.tensor([[(h << 4) | (j + 1) for j, h in enumerate(high)]])
    packed = pack_bits(levels, bits)
    assert packed.tolist() == [[0x21, 0x43, 0x65, 0x87] + high_bytes]
    assert torch.equal(unpack_bits(packed, bits, 8, signed=False), levels.int())


# Relative RMS error bounds on Gaussian rows (measured: int8 row 0.8%, int4 g32 8.6%).
ERROR_BOUND = {8: 0.012, 6: 0.04, 5: 0.06, 4: 0.11}


@pytest.mark.parametrize("fmt", VARIANTS, ids=lambda f: f.name)
def test_roundtrip_error_and_size(fmt):
    x = gaussian_rows()
    packed = quantize_table(x, fmt)
    y = fmt.dequantize(packed, x.shape[1], torch.float32)
    rel = ((y - x).norm() / x.norm()).item()
    bound = 0.035 if isinstance(fmt, Fp8Format) else ERROR_BOUND[fmt.bits]
    assert rel < bound, rel
    assert packed.nbytes * 8 / x.numel() == pytest.approx(fmt.bits_per_weight(x.shape[1]))
    assert fmt.nbytes(*x.shape) == packed.nbytes


def test_search_never_loses_to_plain_scale():
    x = gaussian_rows(cols=640)
    for plain, searched in [
        (IntFormat("a", 4, 32), IntFormat("a", 4, 32, search=5)),
        (IntFormat("a", 5, 32, symmetric=False), IntFormat("a", 5, 32, symmetric=False, search=5)),
    ]:
        errs = [
            (f.dequantize(f.quantize(x), 640, torch.float32) - x).pow(2).sum()
            for f in (plain, searched)
        ]
        assert errs[1] < errs[0]


def test_zero_rows_and_padding_rows_stay_zero():
    x = gaussian_rows()
    x[3] = 0
    for fmt in VARIANTS:
        y = fmt.dequantize(quantize_table(x, fmt), x.shape[1], torch.float32)
        assert torch.isfinite(y).all()
        assert torch.equal(y[3], torch.zeros_like(y[3]))


def test_non_finite_rows_raise_and_leave_input_untouched():
    x = gaussian_rows().bfloat16()
    x[10, 5] = float("nan")
    before = x.clone()
    with pytest.raises(ConversionError, match="row 10"):
        quantize_table(x, FORMATS["int8"])
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("joint", [None, False, True])
def test_chunking_bounds_rows_per_chunk_and_matches_one_shot(joint):
    x = gaussian_rows(rows=300)
    importance = None
    if joint is not None:  # with importance weights, and with rows rounded jointly (GPTQ)
        h = torch.randn(2000, x.shape[1], generator=torch.Generator().manual_seed(3))
        importance = ColumnImportance.from_second_moment(h.T @ h / 2000, joint)
    fmt = IntFormat("a", 6, 64, search=2)
    one_shot = fmt.quantize(x, importance)
    rows_seen = []
    original = fmt.quantize

    class Spy(IntFormat):
        def quantize(self, rows, importance=None, round_group=None):
            rows_seen.append(rows.shape[0])
            return original(rows, importance, round_group)

    spy = Spy("a", 6, 64, search=2)
    budget = 64 * 576 * convert.SCRATCH_BYTES_PER_ELEMENT
    chunked = quantize_table(x, spy, scratch_bytes=budget, importance=importance)
    assert max(rows_seen) == 64 and sum(rows_seen) == 300
    for name, tensor in one_shot.tensors().items():
        assert torch.equal(tensor, getattr(chunked, name))


def test_make_format_overrides_group_size():
    assert make_format("int8").group_size == FORMATS["int8"].group_size
    assert make_format("int8", group_size=32).group_size == 32 != FORMATS["int8"].group_size
    assert make_format("int4", group_size=128).group_size == 128 != FORMATS["int4"].group_size
