"""`vllm-embed-plugin`: check settings, plan savings, measure fidelity, prepare real models.

Every subcommand reads settings through the same code as the plugin inside vLLM, so the two
cannot disagree.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from ..memory import GiB
from . import ToolError, run_command
from .plan import KV_CACHE_DTYPES

#: The package vLLM's entry point names (the runtime, not these tools).
PACKAGE = __name__.split(".")[0]


def cmd_check(args) -> int:
    from ..settings import EmbedSettingsError, load_settings

    try:
        settings = load_settings()
    except EmbedSettingsError as exc:
        raise ToolError(str(exc)) from None
    print(f"settings: {settings.summary()}")
    for line in _installation(settings):
        print(line)
    if not settings.active:
        print("the plugin is inactive: vLLM runs exactly as without it")
    for model in args.model:
        decision = settings.decide(model)
        print(decision)
        head = _head_role(decision, model)
        if head:
            print(head)
    return 0


def _head_role(decision, model: str) -> str | None:
    """What head_format does for `model`, when its config.json is at hand to say if it is tied."""
    from .plan import load_config

    if not decision.convert_head or not (Path(model) / "config.json").is_file():
        return None
    config = load_config(model)
    if config.get("tie_word_embeddings", config["_top"].get("tie_word_embeddings", False)):
        return (
            f"  LM head: tied to the embedding, so it follows format={decision.format!r}; "
            f"head_format={decision.head_format!r} is not used"
        )
    return f"  LM head: untied, converted to {decision.head_format!r} (head_format)"


def _installation(settings) -> list[str]:
    """Which vLLM is installed and whether the plugin acts on it; how vLLM finds the plugin."""
    from importlib import metadata

    from ..compat import detect

    lines = []
    dists = metadata.packages_distributions().get("vllm", [])
    dist = (
        f" (distribution {', '.join(f'{d} {metadata.version(d)}' for d in dists)})" if dists else ""
    )
    support = detect()
    lines.append(f"vllm: {support.version or 'not installed'}{dist}")
    lines.append(f"vllm: {support.describe(settings.untested_vllm)}")
    ours = [
        ep
        for ep in metadata.entry_points(group="vllm.general_plugins")
        if ep.value.split(":")[0] == PACKAGE
    ]
    if not ours:
        lines.append(
            "entry point: none in vllm.general_plugins: vLLM will not load this plugin "
            "(install the package, e.g. pip install vllm-embed-plugin)"
        )
    for ep in ours:
        where = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
        where += f", {Path(__file__).parent.parent}"
        lines.append(f"entry point: vllm.general_plugins {ep.name} = {ep.value} ({where})")
        allowed = os.environ.get("VLLM_PLUGINS")
        if allowed is not None and ep.name not in allowed.split(","):
            lines.append(
                f"entry point: VLLM_PLUGINS={allowed!r} does not name {ep.name!r}: "
                "vLLM will not load this plugin"
            )
    return lines


def _gpu_memory(gib: float | None) -> tuple[int, str]:
    """(bytes, where the figure comes from): as given, else this machine's first GPU, else 24 GiB."""
    if gib is not None:
        return int(gib * GiB), "--gpu-memory-gib"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"this machine's {props.name}"
    return 24 * GiB, "no GPU here: a 24 GiB card; set --gpu-memory-gib"


def cmd_plan(args) -> int:
    from .plan import load_config, plan

    try:
        config = load_config(args.model)
    except (OSError, ValueError) as exc:  # a missing path, or a config.json that is not JSON
        raise ToolError(str(exc)) from None
    info, rows = plan(config, args.max_model_len, args.tensor_parallel_size, args.kv_cache_dtype)
    layout = info["layout"]
    print(f"model: {args.model}")
    print(
        f"token table: {info['table']}, LM head {'tied (one table serves both)' if info['tied'] else 'untied'}"
    )
    print(
        f"KV cache: {info['kv_bytes_per_token']} bytes per token per GPU "
        f"({layout.layers} layers x {layout.kv_heads} KV heads x {layout.head_dim} x 2 x {layout.dtype_bytes} B"
        + (f"; {layout.sliding_layers} sliding-window layers" if layout.sliding_layers else "")
        + ")"
    )
    gpu_bytes, gpu = _gpu_memory(args.gpu_memory_gib)
    print(f"GPU memory: {gpu_bytes / GiB:.1f} GiB ({gpu})")
    header = f"{'format':<10} {'table GiB':>10} {'freed GiB':>10} {'% of GPU':>9} {'+KV tokens':>12} {f'+seqs@{args.max_model_len}':>12}  storage"
    print(header)
    for row in rows:
        share = 100 * row.freed_bytes / gpu_bytes
        print(
            f"{row.format:<10} {row.table_bytes / GiB:>10.3f} {row.freed_bytes / GiB:>10.3f} {share:>8.1f}% "
            f"{row.extra_kv_tokens:>12,} {row.extra_sequences:>12.1f}  {row.description}"
        )
    return 0


def cmd_eval(args) -> int:
    from . import evaluate

    return evaluate.main(args.eval_args, prog="vllm-embed-plugin eval")


def cmd_demo(args) -> int:
    from . import demo

    return demo.main(args.demo_args)


def cmd_calibrate(args) -> int:
    import torch

    from .. import importance
    from . import calibrate
    from .real_models import resolve

    if args.engine == "vllm" and (args.device is not None or args.threads):
        raise ToolError("--device and --threads belong to --engine transformers")
    if args.engine != "vllm" and (
        args.tensor_parallel_size != 1 or args.max_num_batched_tokens is not None
    ):
        raise ToolError(
            "--tensor-parallel-size and --max-num-batched-tokens belong to --engine vllm"
        )
    corpus = args.corpus or calibrate.default_corpus()
    if not corpus.is_file():
        raise ToolError(f"--corpus {corpus}: no such file")
    path = resolve(args.model)
    window = args.window or calibrate.DEFAULT_WINDOW
    positions = args.positions or calibrate.DEFAULT_POSITIONS
    text = corpus.read_text(encoding="utf-8")
    if args.engine == "vllm":
        from .calibrate_vllm import measure_vllm

        fisher = None  # vLLM runs no backward pass: M only (importance.py)
        moment, meta = measure_vllm(
            path,
            text,
            window=window,
            max_positions=positions,
            dtype=args.dtype or "auto",
            tensor_parallel_size=args.tensor_parallel_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            progress=not args.no_progress,
        )
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        moment, fisher, meta = calibrate.measure(
            path,
            text,
            window=window,
            max_positions=positions,
            device=args.device or "cpu",
            dtype=getattr(torch, args.dtype or "float32"),
            progress=not args.no_progress,
        )
    meta["corpus"] = str(corpus)
    # Names the exact text measured, so a shipped file can be checked against its corpus.
    meta["corpus_sha256"] = hashlib.sha256(corpus.read_bytes()).hexdigest()
    out = args.out or calibrate.default_out(path)
    importance.save(out, moment, meta, fisher)
    values = moment.diagonal()
    top = values.topk(min(4, values.numel()))
    print(
        f"measured E[h h^T] on {meta['positions']} positions of {corpus}; column importance "
        f"largest {', '.join(f'{v:.3g} (column {i})' for v, i in zip(top.values.tolist(), top.indices.tolist()))}, "
        f"median {values.median().item():.3g}"
    )
    if fisher is not None:
        print(
            "measured the lookup's Fisher information S on the same positions: a tied table "
            "is rounded against M + S"
        )
    elif meta["tied"]:
        print(
            "a tied model: without the lookup's Fisher information (only --engine transformers "
            "measures it) its table is rounded against M alone"
        )
    print(f"wrote {out}; use it with:")
    print(f"  VLLM_EMBED_IMPORTANCE={out}")
    return 0


def cmd_prepare(args) -> int:
    from .real_models import prepare

    print(prepare(args.name))
    return 0


#: Subcommands whose own parser reads every argument after the name (argparse's REMAINDER
#: would hand a leading option such as `eval --model X` to the top-level parser instead).
PASS_THROUGH = {"eval": cmd_eval, "demo": cmd_demo}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="vllm-embed-plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"vllm-embed-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser(
        "check",
        help="validate VLLM_EMBED_* and the config file; show the vLLM found and each decision",
    )
    check.add_argument("model", nargs="*", help="model names or paths as given to vLLM")
    check.set_defaults(func=cmd_check)

    plan = sub.add_parser("plan", help="bytes and KV-cache tokens each format would free")
    plan.add_argument("model", help="model directory or config.json")
    plan.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="the GPU's memory (default: this machine's first GPU, else 24)",
    )
    plan.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="as vLLM's --max-model-len: the sequence length the extra sequences are counted at",
    )
    plan.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="as vLLM's: the KV cache is split over this many GPUs (default 1)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="as vLLM's --kv-cache-dtype ('auto': the model's dtype)",
    )
    plan.set_defaults(func=cmd_plan)

    evaluate = sub.add_parser(
        "eval", help="fidelity report (KL divergence vs BF16) on a real model", add_help=False
    )
    evaluate.add_argument("eval_args", nargs=argparse.REMAINDER)
    evaluate.set_defaults(func=cmd_eval)

    demo = sub.add_parser(
        "demo", help="chat with a real model in vLLM, plugin off then on", add_help=False
    )
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=cmd_demo)

    calibrate_cmd = sub.add_parser(
        "calibrate", help="measure a model's column importance once; the scale search then uses it"
    )
    calibrate_cmd.add_argument(
        "model", help="model directory (a Hugging Face checkpoint), smollm2 or gemma3-270m"
    )
    calibrate_cmd.add_argument(
        "--out",
        type=Path,
        default=None,
        help="file to write (default: the cache, named after the model directory)",
    )
    calibrate_cmd.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="plain text (default: the packaged corpus of prose, code and chat "
        "in several languages)",
    )
    calibrate_cmd.add_argument(
        "--positions",
        type=int,
        default=None,
        help="at most this many tokens, in whole windows spread over the corpus without "
        "overlap (default 16384, a cap: the packaged corpus holds fewer, so all its whole windows "
        "are measured, 15,872 tokens of SmolLM2's or 12,800 of Gemma 3's; the count measured "
        "is printed)",
    )
    calibrate_cmd.add_argument(
        "--window", type=int, default=None, help="tokens per window (default 512)"
    )
    calibrate_cmd.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="what runs the model: transformers (on --device, default), or a vLLM engine "
        "on whatever device vLLM runs (a GPU for large models; the plugin is off in it)",
    )
    calibrate_cmd.add_argument(
        "--device",
        default=None,
        help="torch device for the transformers forward pass, e.g. cuda (default cpu)",
    )
    calibrate_cmd.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the model's dtype in the forward pass (default float32 with transformers, "
        "the checkpoint's own with vllm)",
    )
    calibrate_cmd.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="with --engine vllm: GPUs to split the model over (default 1)",
    )
    calibrate_cmd.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="with --engine vllm: as vLLM's; lower it to prefill the windows in smaller chunks "
        "(less memory)",
    )
    calibrate_cmd.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    calibrate_cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    calibrate_cmd.set_defaults(func=cmd_calibrate)

    prepare = sub.add_parser(
        "prepare-model", help="build the cached BF16 checkpoint of a real model"
    )
    prepare.add_argument("name", help="smollm2 or gemma3-270m")
    prepare.set_defaults(func=cmd_prepare)
    return parser


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        key = "eval_args" if argv[0] == "eval" else "demo_args"
        return PASS_THROUGH[argv[0]](argparse.Namespace(**{key: argv[1:]}))
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """The `vllm-embed-plugin` command: an operator's mistake is one line and exit code 2."""
    return run_command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
