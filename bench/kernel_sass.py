"""What a word-tile kernel ('wdot') or a generic tile kernel ('tiles', `--kernel tiles`)
compiles to on Hopper, without a GPU: Triton compiles it for sm_90 on the CPU and nvdisasm
(shipped with Triton) lists the SASS. Prints the instruction mix of the main loop, register
spills, the wgmma shape, and whether each wgmma is waited for before the next tile is
decoded (`wait 0`) or overlaps it (`wait N`, N > 0).

    python bench/kernel_sass.py --bits 8 --bm 256 --bn 64 --cpt 64 --warps 8 --stages 3 --noswap
    python bench/kernel_sass.py --bits 8 --bm 256 --bn 128 --cpt 64 --warps 8 --stages 3
    python bench/kernel_sass.py --kernel tiles --bits 6 --group 64 --bm 16 --bn 64 --cpt 128 \
        --warps 4 --stages 4 --const WORDS=1

Integer arguments and pointers are specialised as a real launch on the benchmark tables
specialises them (divisible by 16): without that, Triton cannot vectorise x's loads. A proxy
for speed, not a timing: docs/BENCHMARKS.md's figures come from the GPU. To compile with
the device's Triton rather than this checkout's: `pip install --target DIR --no-deps
triton==3.6.0` and run with `PYTHONPATH=DIR`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The pointers' element types as on the benchmark tables (x and logits BF16, FP16 scales);
#: every other runtime argument is an int32 size or stride.
POINTERS = dict(
    x_ptr="*bf16",
    words_ptr="*i32",
    scales_ptr="*fp16",
    mins_ptr="*fp16",
    out_ptr="*bf16",
    codes8_ptr="*u8",
)
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def wdot_kernel(a):
    from vllm_embed_plugin.kernels import gemm_words
    from vllm_embed_plugin.kernels.gemm_words import block_shape

    u, p = block_shape(a.bits)
    consts = dict(BM=a.bm, BN=a.bn, T=max(1, a.cpt // p), BITS=a.bits, U=u, P=p, GROUP=a.group,
                  SIGNED=True, FP8=False, HAS_MIN=False, SPLIT=False, EVEN=True, SB=False,
                  SWAP=not a.noswap, GPOST=a.gpost, PACK=a.pack, PTX=True)  # fmt: skip
    return gemm_words._wdot_kernel, consts, {}


def tiles_kernel(a):
    """The generic tiles' FAST path as `linear_tiles` launches it on a table of `--bits`."""
    from vllm_embed_plugin.formats.integer import high_bits
    from vllm_embed_plugin.kernels import gemm_tiles
    from vllm_embed_plugin.kernels.nibbles import nibble_asm

    high = high_bits(a.bits)
    consts = dict(BM=a.bm, BN=a.bn, NKC=a.cpt // 8, SWAP=not a.noswap, SPLIT=False,
                  POST_SCALE=a.group == 0 and not a.affine, FAST=True, BITS=a.bits, HIGH=high,
                  U=1, UNIT_BITS=32, HU=1, GROUP=a.group, SIGNED=not a.affine, FP8=False,
                  HAS_MIN=a.affine, EVEN_K=True, MAGIC=True, WORDS=False)  # fmt: skip
    consts.update(a.const)
    consts["ASM"] = ""
    if consts.get("WORDS"):  # the PTX `linear_tiles` passes for BF16 x
        scaled = not a.affine and a.group > 0
        consts["ASM"] = nibble_asm("bf16", not a.affine, scaled=scaled, high=high, f32=a.affine)
    pointers = dict(units_ptr="*i32", high_ptr={0: "*i32", 1: "*u8", 2: "*i16"}[high])
    return gemm_tiles._linear_kernel, consts, pointers


def compile_kernel(a):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel_fn, consts, pointers = (tiles_kernel if a.kernel == "tiles" else wdot_kernel)(a)
    pointers = POINTERS | pointers
    runtime = [p.name for p in kernel_fn.params if not p.is_constexpr]  # in the kernel's order
    signature = {n: pointers.get(n, "i32") for n in runtime} | {k: "constexpr" for k in consts}
    # scale_stride is 1 for per-row scales: the only argument left unspecialised.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(runtime) if n != "scale_stride"}
    src = ASTSource(kernel_fn, signature, consts, attrs)
    options = dict(num_warps=a.warps, num_stages=a.stages)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout


def main_loop(lines: list[str]) -> list[str]:
    """The longest backward branch's body: from its label to the branch."""
    labels = {
        m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))
    }
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    start, end = max(spans, key=lambda span: span[1] - span[0], default=(0, len(lines) - 1))
    return lines[start : end + 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernel", choices=("wdot", "tiles"), default="wdot")
    ap.add_argument("--bits", type=int, default=8, help="4, 5, 6 or 8")
    ap.add_argument("--group", type=int, default=0, help="group size (0: one scale per row)")
    ap.add_argument("--bm", type=int, default=256, help="rows of x per tile")
    ap.add_argument("--bn", type=int, default=64, help="rows of the table per tile")
    ap.add_argument("--cpt", type=int, default=64, help="columns per tile (T * P)")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--noswap", action="store_true", help="x on the left (SWAP=False)")
    ap.add_argument("--gpost", action="store_true", help="one dot per group, scaled after")
    ap.add_argument("--pack", action="store_true", help="4-bit levels two per instruction")
    ap.add_argument("--affine", action="store_true", help="tiles: unsigned codes with minimums")
    ap.add_argument(
        "--const",
        type=lambda s: (s.split("=")[0], int(s.split("=")[1])),
        action="append",
        default=[],
        help="tiles: override a constexpr, NAME=int",
    )
    a = ap.parse_args()
    lines = compile_kernel(a).splitlines()
    loop = main_loop(lines)
    mix = collections.Counter(m.group(1) for line in loop if (m := OPCODE.search(line)))
    total = sum(1 for line in lines if OPCODE.search(line))
    spills = sum(1 for line in lines if re.search(r"\b(LDL|STL)\b", line))
    mma = sorted({m.group(0) for line in lines if (m := re.search(r"HGMMA\.\S+|HMMA\.\S+", line))})
    waits = collections.Counter(re.findall(r"DEPBAR\.LE gsb0, (0x[0-9a-f]+)", "\n".join(lines)))
    weights = a.bn * a.cpt / (32 * a.warps)  # one pass of the loop, per thread
    print(
        f"{total} instructions, {sum(mix.values())} in the main loop "
        f"({sum(mix.values()) / weights:.2f} a weight), {spills} spill loads/stores"
    )
    print(f"tensor-core instructions: {', '.join(mma) or 'none'}; wgmma waits: {dict(waits)}")
    print("main loop: " + ", ".join(f"{op} {n}" for op, n in mix.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
