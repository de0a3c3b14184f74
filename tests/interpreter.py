"""Run a check script in a fresh Python with Triton's CPU interpreter (`TRITON_INTERPRET=1`
must be set before Triton is imported, so not in the pytest process itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_in_interpreter(code: str, timeout: int) -> None:
    """Run `code` (which may import the test modules and must print "ok") interpreted."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + code
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
