import os

import pytest


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """Each test starts with no VLLM_EMBED_* settings and fresh cached settings."""
    for key in list(os.environ):
        if key.startswith("VLLM_EMBED_") and key != "VLLM_EMBED_CACHE":
            monkeypatch.delenv(key)
    from vllm_embed_plugin.settings import current_settings

    current_settings.cache_clear()
    yield
    current_settings.cache_clear()


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine the GPU tests run the same Triton kernels compiled, so the interpreter
    lane (for machines without a GPU) is skipped there; the interpreter of older Triton
    releases also fails under NumPy 2.5 (its program ids are 1-element arrays)."""
    import torch

    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA present: the GPU tests run these kernels compiled")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)


#: A test that takes longer than this (setup, call and teardown together) gets a line of its
#: own as it finishes, so a long run (the end-to-end tests: minutes of engines) shows progress.
SLOW_S = 10.0
_started = {}
_spent = {}


def pytest_sessionstart(session):
    import time

    _started["session"] = time.monotonic()
    _started["reporter"] = session.config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logreport(report):
    import time

    seconds, outcome = _spent.get(report.nodeid, (0.0, "passed"))
    if report.outcome != "passed":  # failed, or skipped (a skip in setup skips the test)
        outcome = "FAILED" if report.failed else report.outcome
    if report.when != "teardown":
        _spent[report.nodeid] = (seconds + report.duration, outcome)
        return
    del _spent[report.nodeid]
    seconds += report.duration
    reporter = _started.get("reporter")
    if seconds >= SLOW_S and reporter is not None:
        elapsed = int(time.monotonic() - _started["session"])
        # Under -q the dots have no file prefix, which is all that ensure_newline checks.
        reporter.ensure_newline()
        if reporter._tw.width_of_current_line:
            reporter._tw.line()
        reporter._tw.line(
            f"  {report.nodeid}: {outcome} in {seconds:.0f} s "
            f"({elapsed // 60}:{elapsed % 60:02d} into the run)"
        )
