"""PTX that turns a 32-bit word of eight 4-bit codes into 16-bit floats two per instruction
(Marlin's trick), for the kernels that read 4-bit codes as words: `gemm_words` (PACK) and
`gemm_tiles` (WORDS). A string per variant, a constexpr for `tl.inline_asm_elementwise`."""

from __future__ import annotations

import triton.language as tl


def nibble_asm(dt: str, signed: bool, scaled: bool = False) -> str:
    """PTX for `gemm_words._nibble_levels` and `gemm_tiles._word_tile`: the word's 8 codes as
    4 pairs of 16-bit floats, nibble J in the low half and J + 4 in the high half (one shift and one LOP3 per pair: mask, sign flip
    and exponent of 2^7 (bf16) or 2^10 (fp16) at once, so the pair is 2^E + code), then one
    packed fma subtracts 2^E (+ 8 for two's complement codes, whose flipped sign bit makes
    them code + 8): exact small integers, two per instruction. sm_80 and newer.
    `scaled` (the generic tiles' words, `gemm_tiles._word_tile`): each level times the scale
    in $9, rounded once as the reference rounds level * scale: fp16 by one product; bf16 by
    level * s_lo (exact: s_lo = scale - s_hi holds at most 3 significant bits, a level at most
    4) then one fma with s_hi ($9) and s_lo ($10), for codes of at most 5 bits."""
    base = {"bf16": 0x4300, "fp16": 0x6400}[dt]  # 2^7 / 2^10: the code's bits are the units
    one = {"bf16": 0x3F80, "fp16": 0x3C00}[dt]
    flip = 8 if signed else 0
    # -(2^E + flip) in dt: the mantissa's units are 1, so the flip adds to its low bits.
    offset = (base | flip) | 0x8000
    op = f"fma.rn.{dict(bf16='bf16', fp16='f16')[dt]}x2"

    def two(h: int) -> str:
        return f"0x{h:04X}{h:04X}"

    lines = [f"mov.b32 one, {two(one)};", f"mov.b32 off, {two(offset)};", "mov.b32 nz, 0x80008000;"]
    for j in range(4):
        src = "$8"
        if j:
            lines.append(f"shr.u32 t, $8, {4 * j};")
            src = "t"
        lines.append(f"lop3.b32 p{j}, {src}, 0x000F000F, {two(base | flip)}, 0x6A;")  # (a & b) ^ c
        lines.append(f"{op} p{j}, p{j}, one, off;")
        if scaled and dt == "bf16":
            lines.append(f"{op} q, p{j}, $10, nz;")  # level * s_lo, exact (+ -0 keeps it)
            lines.append(f"{op} p{j}, p{j}, $9, q;")
        elif scaled:
            lines.append(f"{op} p{j}, p{j}, $9, nz;")
        lines.append(f"mov.b32 {{${j}, ${j + 4}}}, p{j};")
    return "{\n.reg .b32 t, one, off, nz, q, p0, p1, p2, p3;\n" + "\n".join(lines) + "\n}"


NIBBLES_BF16_SIGNED = tl.constexpr(nibble_asm("bf16", True))
NIBBLES_BF16 = tl.constexpr(nibble_asm("bf16", False))
NIBBLES_FP16_SIGNED = tl.constexpr(nibble_asm("fp16", True))
NIBBLES_FP16 = tl.constexpr(nibble_asm("fp16", False))

SCALED_NIBBLES_BF16 = tl.constexpr(nibble_asm("bf16", True, scaled=True))
SCALED_NIBBLES_FP16 = tl.constexpr(nibble_asm("fp16", True, scaled=True))
