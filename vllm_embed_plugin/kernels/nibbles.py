"""PTX that turns a 32-bit word of eight 4-bit codes (with their high bits, for 5- and 6-bit
codes stored as two planes) into 16-bit floats two per instruction (Marlin's trick), for the
kernels that read codes as words: `gemm_words` (PACK) and `gemm_tiles` (WORDS). A string per
variant, a constexpr for `tl.inline_asm_elementwise`."""

from __future__ import annotations

import triton.language as tl


def nibble_asm(
    dt: str, signed: bool, scaled: bool = False, high: int = 0, f32: bool = False
) -> str:
    """PTX for `gemm_words._nibble_levels` and `gemm_tiles._word_tile`: the 8 codes of the
    word in $8 as 4 pairs of 16-bit floats, code J in the low half and J + 4 in the high half.
    Per pair one shift and one LOP3 (mask, sign flip and exponent of 2^7 (bf16) or 2^10 (fp16)
    at once, so the pair is 2^E + code), then one packed fma subtracts 2^E (+ the flipped sign
    bit's weight for two's complement codes, which the flip made code + 2^(bits-1)): exact
    small integers, two per instruction. sm_80 and newer.

    `high` (1 or 2): 5- or 6-bit codes, the word their low nibbles, $9 their high bits (the
    chunk's 8 or 16 bits of the high plane, code J's at bit high * J). Spread once a word so
    that code J's sit 16 bits below code J + 4's (one multiplication or PRMT), then shifted to
    bit 4 of each half and XOR-ed into each pair by one shift (none for one pair of 6-bit
    codes) and one LOP3. Without `high`, $9 is not read.

    `scaled` (two's complement codes; the scale's operands in $10 and $11): each level
    times the scale, rounded once as the reference rounds level * scale: fp16 by one product
    with the scale; bf16 with the scale split into s_hi = bf16(scale) and s_lo = scale - s_hi
    (two operands): s_lo holds at most 2 significant bits of an fp16 scale, so level * s_lo is
    exact in bf16 for levels of up to 6 significant bits (every code here), and one fma
    level * s_hi + (level * s_lo) rounds the exact product once.

    `f32` (bf16 only; for affine codes, whose level * scale + minimum the caller computes in
    float32): the 8 levels as float32, a bf16 level being the top half of its float32 (one
    shift or AND each, in place of a conversion)."""
    base = {"bf16": 0x4300, "fp16": 0x6400}[dt]  # 2^7 / 2^10: the code's bits are the units
    one = {"bf16": 0x3F80, "fp16": 0x3C00}[dt]
    flip = (8 << high) if signed else 0  # the code's sign bit
    # -(2^E + flip) in dt: the mantissa's units are 1, so the flip adds to its low bits.
    offset = (base | flip) | 0x8000
    op = f"fma.rn.{dict(bf16='bf16', fp16='f16')[dt]}x2"

    def two(h: int) -> str:
        return f"0x{h:04X}{h:04X}"

    lines = [f"mov.b32 one, {two(one)};", f"mov.b32 off, {two(offset)};", "mov.b32 nz, 0x80008000;"]
    if high == 1:  # bit J to bit 4 + J, bit J + 4 to bit 20 + J: the pair's shift is J
        lines.append("mul.lo.u32 v, $9, 0x10010;")
    elif high == 2:  # byte 1 to byte 2: code J's bits at 2J, J + 4's at 16 + 2J; shift 4 - 2J
        lines.append("prmt.b32 v, $9, 0, 0x4140;")
    for j in range(4):
        src = "$8"
        if j:
            lines.append(f"shr.u32 t, $8, {4 * j};")
            src = "t"
        lines.append(f"lop3.b32 p{j}, {src}, 0x000F000F, {two(base | flip)}, 0x6A;")  # (a & b) ^ c
        if high:
            left = 4 - 2 * j if high == 2 else -j  # where the pair's high bits go, from v
            hsrc = "u"
            if left > 0:
                lines.append(f"shl.b32 u, v, {left};")
            elif left < 0:
                lines.append(f"shr.u32 u, v, {-left};")
            else:
                hsrc = "v"
            mask = two(((1 << high) - 1) << 4)
            lines.append(f"lop3.b32 p{j}, {hsrc}, {mask}, p{j}, 0x6A;")  # bits 4.. of each code
        lines.append(f"{op} p{j}, p{j}, one, off;")
        if scaled and dt == "bf16":
            lines.append(f"{op} q, p{j}, $11, nz;")  # level * s_lo, exact (+ -0 keeps it)
            lines.append(f"{op} p{j}, p{j}, $10, q;")
        elif scaled:
            lines.append(f"{op} p{j}, p{j}, $10, nz;")
        if f32:
            lines.append(f"shl.b32 ${j}, p{j}, 16;")
            lines.append(f"and.b32 ${j + 4}, p{j}, 0xFFFF0000;")
        else:
            lines.append(f"mov.b32 {{${j}, ${j + 4}}}, p{j};")
    return "{\n.reg .b32 t, u, v, one, off, nz, q, p0, p1, p2, p3;\n" + "\n".join(lines) + "\n}"


NIBBLES_BF16_SIGNED = tl.constexpr(nibble_asm("bf16", True))
NIBBLES_BF16 = tl.constexpr(nibble_asm("bf16", False))
NIBBLES_FP16_SIGNED = tl.constexpr(nibble_asm("fp16", True))
NIBBLES_FP16 = tl.constexpr(nibble_asm("fp16", False))
