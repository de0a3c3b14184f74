"""The main job, shown: chat with a real model in vLLM with the plugin off, then on.

    python -m vllm_embed_plugin.demo [--model smollm2|gemma3-270m|DIR] [--format int8]

Each run is a fresh vLLM engine (CPU backend here) in its own process; the plugin is loaded by
vLLM through its entry point. Prints the answers, the bytes of the vocabulary tables (a tied
head's shared table counted once) and vLLM's KV-cache size side by side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .probe import run_probe

GiB = 1 << 30
QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-embed-plugin demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a real model name or a checkpoint directory")
    parser.add_argument("--format", default="int8")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model = Path(args.model)
    if not model.is_dir():
        from .real_models import prepare

        print(f"preparing {args.model} (converted once from its PyPI package, then cached) ...", flush=True)
        model = prepare(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for fmt in ("off", args.format):
            print(f"running vLLM with VLLM_EMBED_FORMAT={fmt} ...", flush=True)
            run = run_probe(
                Path(out), fmt, {"VLLM_EMBED_FORMAT": fmt}, "--model", str(model),
                "--chat", args.question, "--max-tokens", str(args.max_tokens),
            )
            if run.returncode != 0:
                print(run.log[-4000:], file=sys.stderr)
                return run.returncode
            report = run.result["workers"][0]["target"]
            rows.append((fmt, report["vocab_bytes"], run.result["kv_cache_tokens"], run.result["texts"][0]))

    print(f"\nmodel: {model}\nquestion: {args.question}\n")
    print(f"{'format':<8} {'vocab tables':>13} {'KV cache':>16}  answer")
    for fmt, nbytes, kv, text in rows:
        print(f"{fmt:<8} {nbytes / GiB:>9.3f} GiB {kv:>9,} tokens  {text.strip()!r}")
    (_, bf16, kv0, _), (_, packed, kv1, _) = rows
    print(f"\n{args.format}: vocabulary tables {packed / bf16:.2f}x of BF16, KV cache {kv1 - kv0:+,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
