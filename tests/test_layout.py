"""The package's architecture, read from its imports (lazy ones included): the runtime that
vLLM loads never reaches the operator tooling, and its parts depend on each other one way."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import vllm_embed_plugin

PACKAGE = Path(vllm_embed_plugin.__file__).parent


def _unit(module: str) -> str:
    """The part of the package a module belongs to: `formats`, `kernels`, `tools`, or the
    module's own name for a top-level one (`settings`, `layer`, ...); `__init__` is `root`."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "root"


def _imports() -> dict[str, set[str]]:
    """unit -> the other units it imports anywhere in its code."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else module.rpartition(".")[0]
        unit = _unit(module)
        deps = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` may name a module: count it as that module.
                targets = (
                    [f"{prefix}.{alias.name}" for alias in node.names]
                    if not node.module
                    else [prefix]
                )
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm_embed_plugin"
            ):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("vllm_embed_plugin")]
            for target in targets:
                other = _unit(target)
                if not ((PACKAGE / other).is_dir() or (PACKAGE / f"{other}.py").exists()):
                    other = "root"  # a name defined in the package's __init__ (__version__)
                if other != unit:
                    deps.add(other)
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_runtime_never_imports_the_tools():
    graph = _imports()
    runtime = [unit for unit in graph if unit != "tools"]
    assert "layer" in runtime and "kernels" in runtime and "tools" in graph
    for unit in runtime:
        assert "tools" not in _reaches(graph, unit), f"{unit} reaches the tools"


def test_the_runtime_has_no_import_cycle():
    graph = _imports()
    for unit in graph:
        if unit not in ("root", "tools"):  # the entry point and the tools sit above everything
            assert unit not in _reaches(graph, unit), f"{unit} imports itself through {graph[unit]}"


def test_dependencies_point_one_way():
    """settings -> layer -> method -> convert -> kernels -> formats: never back up the chain."""
    graph = _imports()
    chain = ["layer", "method", "convert", "kernels", "formats"]
    for i, unit in enumerate(chain):
        assert not _reaches(graph, unit) & set(chain[:i]), f"{unit} imports a layer above it"
    assert _reaches(graph, "formats") == set(), "formats know no devices, no vLLM, no settings"


def test_registering_the_plugin_loads_no_tool():
    """What vLLM runs in every process: the entry point, then the layer it registers."""
    code = textwrap.dedent(
        """
        import sys
        import vllm_embed_plugin
        from vllm_embed_plugin import layer, method  # what register() attaches
        vllm_embed_plugin.register()
        loaded = sorted(m for m in sys.modules if m.startswith("vllm_embed_plugin.tools"))
        print(loaded)
        """
    )
    env = {**os.environ, "VLLM_EMBED_FORMAT": "int8"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_no_tool_module_imports_itself_in_a_circle():
    """Within the tools too, every import (TYPE_CHECKING ones included) points one way."""
    tools = PACKAGE / "tools"
    graph: dict[str, set[str]] = {}
    for path in tools.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                deps.update(n.split(".")[0] for n in names if (tools / f"{n}.py").exists())
    assert "fidelity_report" in graph["evaluate"]
    for module in graph:
        assert module not in _reaches(graph, module), f"tools.{module} imports itself back"
