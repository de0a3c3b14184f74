"""Which column importance generalises: int4/int5 + file on the packaged held-out domains,
with M measured several ways. One model per call; prints one line per variant.

    nice -n 15 python bench/calibration_levers.py smollm2 --windows 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vllm_embed_plugin import importance
from vllm_embed_plugin.formats import ColumnImportance, make_format
from vllm_embed_plugin.tools import calibrate, evaluate, real_models


def shrink(m: torch.Tensor, to: str, amount: float) -> torch.Tensor:
    """M mixed with its diagonal ("diag") or with mean(diag) * I ("identity")."""
    target = (
        torch.diag(m.diagonal()) if to == "diag" else m.diagonal().mean() * torch.eye(m.shape[0])
    )
    return (1 - amount) * m + amount * target


def split_constant(h: torch.Tensor, amount: float) -> torch.Tensor:
    """M = mu mu^T + C with only the varying part C shrunk toward its diagonal."""
    mu = h.double().mean(0)
    m = calibrate.second_moment(h).double()
    c = m - torch.outer(mu, mu)
    c = (1 - amount) * c + amount * torch.diag(c.diagonal())
    return (torch.outer(mu, mu) + c).float()


def row(fmt_name: str, weights_of, label: str) -> evaluate.Candidate:
    fmt = make_format(fmt_name, weighted=weights_of is not None)

    def roundtrip(table, measured):
        imp = None if weights_of is None else weights_of(measured.second_moment)
        cols = table.shape[1]

        def one(chunk):
            return fmt.dequantize(fmt.quantize(chunk, imp), cols, torch.float32)

        return evaluate._chunked(table, one)

    return evaluate.Candidate(label, fmt.bits_per_weight(640), roundtrip)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--only", default="", help="comma-separated label endings to run")
    p.add_argument(
        "--licence",
        type=Path,
        default=None,
        help="the licence-only corpus calibrate read before (git show dca516a:"
        "vllm_embed_plugin/data/corpus.txt), for the old M",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    # The variants below shrink M themselves; measure each exactly as labelled.
    ColumnImportance.SHRINK = 0.0
    path = real_models.resolve(args.model)
    old_text = args.licence
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    new_text = calibrate.default_corpus().read_text()
    run = evaluate.FidelityRun(
        path,
        evaluate.packaged_domains(),
        window=args.window,
        windows=args.windows,
        calibration=new_text,
        progress=False,
    )

    def hidden(text, window, positions):
        w = calibrate.spread_windows(tok, text, window, positions // window)
        return run._hidden(run.table, "cal", w)

    h_new = hidden(new_text, 512, 4096)
    moments = {
        "new 4096x512": calibrate.second_moment(h_new),
        "new all x512": calibrate.second_moment(hidden(new_text, 512, 1 << 20)),
        "new 4096x128": calibrate.second_moment(hidden(new_text, 128, 4096)),
        "new 2048x128": calibrate.second_moment(hidden(new_text, 128, 2048)),
    }
    if old_text is not None:
        # The old default: the licence corpus, its first 8 windows of 512.
        ids = calibrate.spread_windows(tok, old_text.read_text(), 512, 1 << 20)[:8]
        moments["licence 4096x512 (old)"] = calibrate.second_moment(
            run._hidden(run.table, "cal", ids)
        )
    base = moments["new 4096x512"]
    for a in (0.1, 0.3):
        moments[f"new, shrink diag {a}"] = shrink(base, "diag", a)
    for a in (0.03, 0.1):
        moments[f"new, shrink identity {a}"] = shrink(base, "identity", a)
    moments["new, constant apart, C to diag 0.3"] = split_constant(h_new, 0.3)
    moments["new, shrink identity 0.2"] = shrink(base, "identity", 0.2)
    moments["new all x512, shrink identity 0.1"] = shrink(moments["new all x512"], "identity", 0.1)

    def wanted(label: str) -> bool:
        """--only: labels ending in one of these (comma-separated) suffixes, or all."""
        return not args.only or any(label.endswith(part) for part in args.only.split(","))

    def tied(moment):
        return ColumnImportance.from_second_moment(moment, joint=True)

    def line(label, r):
        cells = []
        for d in run.domain_names:
            i, t = r.domain(d, "input"), r.domain(d, "tied")
            cells.append(f"{d} in {i.kld_mean:.3e} tied {t.kld_mean:.3e}")
        print(f"{label:<48} " + " | ".join(cells) + f"  ({r.seconds:.0f}s)", flush=True)

    anchors = [evaluate.llama_cpp_row("Q4_0", run.cols), evaluate.llama_cpp_row("Q5_1", run.cols)]
    for c in anchors:
        line(c.label, run.evaluate(c))
    plain = {f: row(f, None, f"{f} plain") for f in ("int4",)}
    for c in plain.values():
        line(c.label, run.evaluate(c))
    # Untied: what the search does for the input side.
    # (The group-by-group guard measured in docs/CALIBRATION.md was removed at the commit after
    # 3728594: an untied table now ignores the file, so only the bare search is left to try.)
    untied = [
        (
            "int4 untied, diag(M), unguarded",
            lambda m: ColumnImportance(m.diagonal().clamp_min(1e-12)),
        ),
    ]
    for source in [m for m in ("new 4096x512", "licence 4096x512 (old)") if m in moments]:
        for label, fn in untied:
            label = f"{label}, M {source}"
            if not wanted(label):
                continue
            run.measured = importance.Calibration(moments[source])
            line(label, run.evaluate(row("int4", fn, label)))
    for name, m in moments.items():
        for f in ("int4", "int5"):
            label = f"{f} tied, M {name}"
            if not wanted(label):
                continue
            run.measured = importance.Calibration(m)
            line(label, run.evaluate(row(f, tied, label)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
