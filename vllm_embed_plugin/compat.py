"""Which vLLM this is, and whether the plugin acts on it: decided by the APIs it needs, not by
a list of releases.

The plugin needs the vLLM APIs in `REQUIRED_APIS`; they exist from vLLM `MINIMUM_VLLM` on.
Below the minimum, or with one of them missing, the plugin stays inert with one warning that
names what is missing. A release newer than `NEWEST_TESTED_VLLM` is served too, with one
warning, unless the setting `untested_vllm` is `"off"`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

#: Oldest vLLM release whose layer and quantization APIs the plugin uses.
MINIMUM_VLLM = (0, 26)
#: Releases the plugin has run on (README, Compatibility): 0.26 CUDA, 0.28 and 0.32 CPU.
TESTED_VLLM = ((0, 26), (0, 28), (0, 32))
NEWEST_TESTED_VLLM = max(TESTED_VLLM)

#: (module, attribute path) of everything the plugin calls in vLLM.
REQUIRED_APIS = (
    ("vllm.model_executor.custom_op", "PluggableLayer.register_oot"),
    ("vllm.model_executor.custom_op", "op_registry_oot"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead.tie_weights"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),
    ("vllm.config", "get_current_vllm_config_or_none"),
    ("vllm.platforms", "current_platform"),
    ("vllm.compilation.backends", "model_tag"),
    ("vllm.utils.torch_utils", "get_accelerator_view_from_cpu_tensor"),
)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '0.32.0+cpu' or '0.34.1rc1.dev3'."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _fmt(rel: tuple[int, int]) -> str:
    return ".".join(map(str, rel))


def missing_apis() -> list[str]:
    """The entries of REQUIRED_APIS that this vLLM lacks, as 'module.attribute'."""
    missing = []
    for module_name, path in REQUIRED_APIS:
        try:
            obj = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except Exception:  # ImportError, AttributeError, or a module that fails to import
            missing.append(f"{module_name}.{path}")
    return missing


@dataclass(frozen=True)
class VllmSupport:
    """What the plugin makes of the installed vLLM."""

    version: str | None
    #: "supported", "untested" (newer than tested), "too-old", "missing-api", "not-installed"
    status: str
    missing: tuple[str, ...] = ()

    def acts(self, untested_vllm: str = "warn") -> bool:
        """Whether the plugin registers its layer on this vLLM."""
        return self.status == "supported" or (self.status == "untested" and untested_vllm == "warn")

    def describe(self, untested_vllm: str = "warn") -> str:
        """One line: the version, and whether and why the plugin acts on it."""
        tested = ", ".join(_fmt(r) for r in TESTED_VLLM)
        version = f"vLLM {self.version}"
        if self.status == "not-installed":
            return "vLLM is not installed: the plugin has nothing to act on"
        if self.status == "too-old":
            return (
                f"{version} is older than {_fmt(MINIMUM_VLLM)}, the oldest release the plugin "
                "supports: it stays inactive and changes nothing"
            )
        if self.status == "missing-api":
            return (
                f"{version} lacks {', '.join(self.missing)}, which the plugin needs: it stays "
                "inactive and changes nothing"
            )
        if self.status == "untested":
            newer = (
                f"{version} is newer than the newest release the plugin was tested on "
                f"({_fmt(NEWEST_TESTED_VLLM)}; tested: {tested})"
            )
            if untested_vllm == "off":
                return (
                    f"{newer}, and VLLM_EMBED_UNTESTED_VLLM=off: the plugin stays inactive and "
                    "changes nothing"
                )
            return (
                f"{newer}; its APIs are all present, so the plugin can act on it "
                "(VLLM_EMBED_UNTESTED_VLLM=off turns it off on untested releases)"
            )
        return f"{version}: supported (tested: {tested}); the plugin can act on it"


def detect(version: str | None = None) -> VllmSupport:
    """Inspect the installed vLLM (imports the modules in REQUIRED_APIS)."""
    if version is None:
        try:
            import vllm
        except ImportError:
            return VllmSupport(None, "not-installed")
        version = getattr(vllm, "__version__", "") or ""
    rel = release(version)
    if rel is not None and rel < MINIMUM_VLLM:
        return VllmSupport(version, "too-old")
    missing = missing_apis()
    if missing:
        return VllmSupport(version, "missing-api", tuple(missing))
    if rel is None or rel > NEWEST_TESTED_VLLM:
        return VllmSupport(version, "untested")
    return VllmSupport(version, "supported")
