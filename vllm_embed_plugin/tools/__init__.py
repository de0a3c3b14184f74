"""Operator tooling: the `vllm-embed-plugin` command line and what it runs.

The plugin's runtime (the package above: settings, layer, method, conversion, formats,
kernels) never imports this package; only `introspect` and `calibrate_vllm` enter a vLLM
worker, and only when a tool sends them there (`LLM.apply_model`). Here: `cli` (the command),
`plan` (memory and KV-cache arithmetic), `calibrate` (measure a column importance; in a vLLM
engine: `calibrate_vllm`), `evaluate` (fidelity of formats against llama.cpp's),
`fidelity_data` (what it measures) and `fidelity_report` (its Markdown report), `demo` and
`probe` (a real vLLM engine with the plugin off and on), `introspect` (what a worker holds),
`real_models` (the two pretrained models that install from the package registry).
"""

import os
import sys
from pathlib import Path

#: The packaged data: the calibration corpus, the held-out evaluation domains, and
#: calibration files for the real models (data/README.md).
DATA_DIR = Path(__file__).parent.parent / "data"
#: Environment variable naming the directory the tools write their caches under.
CACHE_ENV = "VLLM_EMBED_CACHE"


def cache_dir(kind: str) -> Path:
    """Where the tools keep `kind` ("models": the real models' checkpoints, "importance":
    `calibrate`'s files): `$VLLM_EMBED_CACHE/kind`, else `~/.cache/vllm-embed-plugin/kind`.
    Every path the tools write outside a checkout comes from here."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "vllm-embed-plugin"
    return base / kind


class ToolError(Exception):
    """A mistake in what the operator asked for (a missing file, an unknown model): shown as
    one line, `error: ...`, with exit code 2, never as a traceback."""


def run_command(main, argv=None) -> int:
    """main(argv), with a ToolError turned into its one line on stderr and exit code 2."""
    try:
        return main(argv)
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def progress_bar(items, desc: str, enabled: bool = True, total: int | None = None):
    """`items`, shown as a progress bar on stderr while they are consumed (tqdm, from the
    `eval` extra), or as they are when not `enabled`."""
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc[:48], total=total, leave=False, file=sys.stderr)
