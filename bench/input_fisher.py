"""Does the lookup's own cost belong in a table's rounding? Measured on the packaged held-out
domains (8 windows each), one model per call; docs/CALIBRATION.md has the results.

A tied table's row error e costs twice: in the logits, about e M e^T with M = E[h h^T], and in
the lookup, e S e^T with S the Fisher information of the model's output with respect to its
input embedding, averaged over positions (`calibrate.measure_model` measures both on the
calibration corpus). Each variant `a:b` rounds every row jointly against a * (M shrunk as the
plugin shrinks it) + b * S, and `a:b:s` with S shrunk toward mean(diag S) * I by the share s:
`1:0` is M alone (the plugin before S), `1:1` M + S as the plugin rounded a tied table until
S was shrunk too, `1:1:0.1` what it does now (M and S shrunk alike), `0:1` an input-only table
against S alone (its input KLD is the figure that matters there); `plain` is no file. Prints
tied KLD and, in brackets, input-only KLD.

    python bench/input_fisher.py smollm2 --formats int8,int4 --mix plain,1:0,1:1,1:1:0.1,0:1
"""

from __future__ import annotations

import argparse
import sys

import torch
from calibration_levers import row
from calibration_weighting import per_domain, tied_against

from vllm_embed_plugin.formats import ColumnImportance
from vllm_embed_plugin.formats.base import shrink
from vllm_embed_plugin.tools import evaluate, real_models


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument(
        "--mix",
        default="1:0,1:1",
        help="variants a:b or a:b:s, rounding against a * shrunk M + b * S (S shrunk by the "
        "share s); 'plain' for no file",
    )
    args = p.parse_args()
    torch.set_num_threads(2)
    path = real_models.resolve(args.model)
    run = evaluate.FidelityRun(
        path,
        evaluate.packaged_domains(),
        window=256,
        windows=args.windows,
        progress=False,
    )
    measured = run.measured.second_moment.double()
    fisher = run.measured.input_fisher.double()
    print(
        f"trace(S) / trace(M) = {fisher.trace() / measured.trace():.3g}; "
        f"diag(S) max/mean {fisher.diagonal().max() / fisher.diagonal().mean():.3g}, "
        f"diag(M) max/mean {measured.diagonal().max() / measured.diagonal().mean():.3g}",
        flush=True,
    )

    for fmt in args.formats.split(","):
        for mix in args.mix.split(","):
            if mix == "plain":
                line = per_domain(run, run.evaluate(row(fmt, None, f"{fmt} plain")))
            else:
                a, b, *s_share = (float(x) for x in mix.split(":"))
                s_fisher = shrink(fisher, s_share[0]) if s_share else fisher
                moment = a * shrink(measured, ColumnImportance.SHRINK) + b * s_fisher
                line = tied_against(run, fmt, moment, f"{fmt} {mix}")
            print(f"{fmt} {mix:<6} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
