"""Two levers on a tied table's M, measured on the packaged held-out domains (8 windows each):
how far M is shrunk toward mean(diag M) * I, and weighting each calibration position by the
Gini impurity 1 - sum(p^2) of the model's own next-token distribution (for independent row
errors, a position's expected KLD is proportional to it). One model per call; one line per
variant, tied KLD and (in brackets) input-only KLD per domain.

    python bench/calibration_weighting.py smollm2 --formats int8,int4 --shrink 0.1,0.3,0.6
    python bench/calibration_weighting.py smollm2 --formats int8,int4 --gini 0,1,2,0.5
"""

from __future__ import annotations

import argparse
import sys

import torch
from calibration_levers import row

from vllm_embed_plugin import importance
from vllm_embed_plugin.formats import ColumnImportance
from vllm_embed_plugin.formats.base import shrink
from vllm_embed_plugin.tools import calibrate, evaluate, real_models


def gini_weighted(h: torch.Tensor, gini: torch.Tensor, power: float) -> torch.Tensor:
    """E_w[h h^T] with weights gini**power (power 0: M as calibrate measures it)."""
    w = gini.pow(power)
    return ((h * w[:, None]).T @ h / w.sum()).float()


def per_domain(run: evaluate.FidelityRun, result: evaluate.Result) -> str:
    """Tied KLD and, in brackets, input-only KLD of each domain, on one line."""
    return " | ".join(
        f"{d} {result.domain(d, 'tied').kld_mean:.2e} ({result.domain(d, 'input').kld_mean:.2e})"
        for d in run.domain_names
    )


def tied_against(run: evaluate.FidelityRun, fmt: str, moment: torch.Tensor, label: str) -> str:
    """`fmt` with every row rounded jointly against `moment` as given (not shrunk again)."""
    default_shrink = ColumnImportance.SHRINK
    ColumnImportance.SHRINK = 0.0  # from_second_moment would shrink it again
    try:
        run.measured = importance.Calibration(moment.float())
        result = run.evaluate(
            row(fmt, lambda m: ColumnImportance.from_second_moment(m, joint=True), label)
        )
    finally:
        ColumnImportance.SHRINK = default_shrink
    return per_domain(run, result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--shrink", default="", help="shares of mean(diag M) * I mixed into M")
    p.add_argument("--gini", default="", help="powers of the Gini weight (0 = unweighted)")
    args = p.parse_args()
    torch.set_num_threads(2)
    path = real_models.resolve(args.model)
    text = calibrate.default_corpus().read_text()
    run = evaluate.FidelityRun(
        path, evaluate.packaged_domains(), window=256, windows=args.windows, progress=False
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    windows = calibrate.spread_windows(
        tok, text, calibrate.DEFAULT_WINDOW, calibrate.DEFAULT_POSITIONS // calibrate.DEFAULT_WINDOW
    )
    h = run._hidden(run.table, "calibration", windows).double()
    measured = calibrate.second_moment(h)

    variants: dict[str, tuple[torch.Tensor, float]] = {}
    for amount in [float(a) for a in args.shrink.split(",") if a]:
        variants[f"shrink {amount}"] = (measured, amount)
    if args.gini:
        with torch.inference_mode():
            gini = torch.cat(
                [
                    1 - torch.softmax(run._logits(c.float(), run.head).double(), -1).pow(2).sum(-1)
                    for c in h.split(512)
                ]
            )
        print(f"gini over {h.shape[0]} positions: mean {gini.mean():.3f}", flush=True)
        for power in [float(a) for a in args.gini.split(",")]:
            variants[f"gini^{power:g}"] = (gini_weighted(h, gini, power), ColumnImportance.SHRINK)

    for fmt in args.formats.split(","):
        for label, (moment, amount) in variants.items():
            line = tied_against(run, fmt, shrink(moment.double(), amount), f"{fmt} {label}")
            print(f"{fmt} {label:<12} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
