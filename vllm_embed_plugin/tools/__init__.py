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

import sys
from pathlib import Path

#: The packaged texts: the calibration corpus and the held-out evaluation domains.
DATA_DIR = Path(__file__).parent.parent / "data"


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
