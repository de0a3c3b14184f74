"""Operator tooling: the `vllm-embed-plugin` command line and what it runs.

Nothing here runs inside vLLM: the plugin's runtime (the package above: settings, layer,
method, conversion, formats, kernels) never imports this package. Here: `cli` (the command),
`plan` (memory and KV-cache arithmetic), `calibrate` (measure a column importance), `evaluate`
(fidelity of formats against llama.cpp's, and the docs/FIDELITY.md report), `demo` and
`probe` (a real vLLM engine with the plugin off and on), `introspect` (what a worker holds),
`real_models` (the two pretrained models that install from the package registry).
"""

from pathlib import Path

#: The packaged texts: the calibration corpus and the held-out evaluation domains.
DATA_DIR = Path(__file__).parent.parent / "data"
