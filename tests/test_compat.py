"""Which vLLM the plugin acts on: by the APIs it needs, a minimum release, and an opt-out for
releases newer than the tested ones. Pure logic: the version and the APIs are patched."""

from __future__ import annotations

import pytest

import vllm_embed_plugin
from vllm_embed_plugin import compat


@pytest.fixture
def registry(monkeypatch):
    """An empty out-of-tree registry, and the plugin's per-process memory of vLLM cleared."""
    from vllm.model_executor import custom_op

    registry = {}
    monkeypatch.setattr(custom_op, "op_registry_oot", registry)
    monkeypatch.setitem(vllm_embed_plugin._state, "vllm", None)
    monkeypatch.setitem(vllm_embed_plugin._state, "logged", True)
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    return registry


def set_version(monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.32.0", (0, 32)),
        ("0.32.0+cpu", (0, 32)),
        ("0.34.1rc1.dev3+gabc", (0, 34)),
        ("1.0", (1, 0)),
        ("dev", None),
    ],
)
def test_release_parses_what_vllm_reports(text, expected):
    assert compat.release(text) == expected


def register_warnings(caplog, times: int = 1) -> list[str]:
    """Call register() as vLLM does (possibly again in the same process); the warnings."""
    with caplog.at_level("WARNING", logger="vllm.embed_plugin"):
        for _ in range(times):
            vllm_embed_plugin.register()
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_installed_vllm_has_every_api_the_plugin_uses():
    assert compat.missing_apis() == []
    support = compat.detect()
    assert support.status in ("supported", "untested")
    assert support.acts()


@pytest.mark.parametrize(
    "version, status, acts, acts_if_off",
    [
        ("0.25.2", "too-old", False, False),
        ("0.26.0", "supported", True, True),
        ("0.28.0", "supported", True, True),
        ("0.30.1", "supported", True, True),  # inside the tested range
        ("0.32.0+cpu", "supported", True, True),
        ("0.34.0", "untested", True, False),
        ("1.2.0", "untested", True, False),
    ],
)
def test_version_decides_with_the_minimum_and_the_newest_tested(version, status, acts, acts_if_off):
    support = compat.detect(version)
    assert support.status == status
    assert support.acts("warn") is acts
    assert support.acts("off") is acts_if_off


def test_a_missing_api_makes_it_inert_and_is_named(monkeypatch):
    from vllm.utils import torch_utils

    monkeypatch.delattr(torch_utils, "get_accelerator_view_from_cpu_tensor")
    support = compat.detect("0.33.0")
    assert support.status == "missing-api"
    assert support.missing == ("vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor",)
    assert not support.acts()
    assert "lacks vllm.utils.torch_utils.get_accelerator_view_from_cpu_tensor" in support.describe()


def test_newer_vllm_registers_with_one_warning(monkeypatch, registry, caplog):
    set_version(monkeypatch, "0.40.1")
    warnings = register_warnings(caplog, times=2)
    assert set(registry) == {"VocabParallelEmbedding", "ParallelLMHead"}
    assert len(warnings) == 1, warnings
    assert (
        "vLLM 0.40.1 is newer than the newest release the plugin was tested on (0.32" in warnings[0]
    )
    assert "VLLM_EMBED_UNTESTED_VLLM=off" in warnings[0]


def test_untested_vllm_off_leaves_a_newer_vllm_alone(monkeypatch, registry, caplog):
    set_version(monkeypatch, "0.40.1")
    monkeypatch.setenv("VLLM_EMBED_UNTESTED_VLLM", "off")
    register_warnings(caplog)
    assert registry == {}
    assert "VLLM_EMBED_UNTESTED_VLLM=off: the plugin stays inactive" in caplog.text


def test_older_vllm_leaves_the_plugin_inert_with_one_warning(monkeypatch, registry, caplog):
    set_version(monkeypatch, "0.25.0")
    warnings = register_warnings(caplog, times=2)
    assert registry == {}
    assert len(warnings) == 1 and "older than 0.26" in warnings[0], warnings


def test_missing_api_leaves_the_plugin_inert(monkeypatch, registry, caplog):
    import vllm.config

    monkeypatch.delattr(vllm.config, "get_current_vllm_config_or_none")
    register_warnings(caplog)
    assert registry == {}
    assert "lacks vllm.config.get_current_vllm_config_or_none" in caplog.text


def test_supported_vllm_registers_without_a_warning(monkeypatch, registry, caplog):
    set_version(monkeypatch, "0.32.0")
    assert register_warnings(caplog) == []
    assert set(registry) == {"VocabParallelEmbedding", "ParallelLMHead"}
    assert caplog.records == []


def test_untested_vllm_setting_is_typed(monkeypatch):
    from vllm_embed_plugin.settings import EmbedSettingsError, load_settings

    monkeypatch.setenv("VLLM_EMBED_UNTESTED_VLLM", "maybe")
    with pytest.raises(
        EmbedSettingsError, match="VLLM_EMBED_UNTESTED_VLLM='maybe'.*'warn' or 'off'"
    ):
        load_settings()
