"""Refitting the group scales after the joint rounding (`ColumnImportance.REFIT_ROUNDS`),
measured on the packaged held-out domains as `eval` measures a tied table with a file: the
tied mean KLD of each domain and, in brackets, its ratio to the llama.cpp format the README
compares it with. One model per call.

    python bench/scale_refit.py gemma3-270m --formats int8,int5,int4 --refits 0,1,2 --windows 8
"""

from __future__ import annotations

import argparse
import sys

import torch

from vllm_embed_plugin.formats import ColumnImportance, make_format
from vllm_embed_plugin.tools import evaluate, real_models

#: The llama.cpp format (type, shift) each plugin format's target is set against (issue 27).
REFERENCE = {
    "int8": ("Q8_0", evaluate.SHIFT),
    "int5": ("Q5_1", 0),
    "int4": ("Q4_0", 0),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--formats", default="int8,int5,int4")
    p.add_argument("--refits", default="0,1,2", help="values of REFIT_ROUNDS to compare")
    p.add_argument("--windows", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(2)
    path = real_models.resolve(args.model)
    run = evaluate.FidelityRun(
        path, evaluate.packaged_domains(), window=256, windows=args.windows, progress=False
    )
    cols = run.table.shape[1]
    default = ColumnImportance.REFIT_ROUNDS
    for name in args.formats.split(","):
        type_name, shift = REFERENCE[name]
        ref = run.evaluate(evaluate.llama_cpp_row(type_name, cols, shift=shift))
        base = {d: ref.domain(d, "tied").kld_mean for d in run.domain_names}
        print(
            f"{name}: {type_name}{' shifted' if shift else ''} "
            + " | ".join(f"{d} {v:.3e}" for d, v in base.items()),
            flush=True,
        )
        for refits in [int(r) for r in args.refits.split(",")]:
            ColumnImportance.REFIT_ROUNDS = refits
            try:
                fmt = make_format(name, weighted=True)
                result = run.evaluate(evaluate.plugin_row(fmt, cols, role="tied"))
            finally:
                ColumnImportance.REFIT_ROUNDS = default
            cells = []
            for d in run.domain_names:
                kld = result.domain(d, "tied").kld_mean
                cells.append(f"{d} {kld:.3e} ({kld / base[d]:.3f}x)")
            print(f"{name} refits={refits}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
