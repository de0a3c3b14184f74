import textwrap

import pytest

from vllm_embed_plugin.settings import EmbedSettingsError, load_settings


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_default_is_off_and_inactive():
    settings = load_settings()
    assert settings.format == "off"
    assert not settings.active
    assert not settings.decide("any/model").convert


def test_env_format_and_allowlist(monkeypatch):
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    monkeypatch.setenv("VLLM_EMBED_MODELS", "Qwen/*, my-llama")
    settings = load_settings()
    assert settings.models == ["Qwen/*", "my-llama"]
    assert settings.decide("Qwen/Qwen3-8B").format == "int8"
    # A local path also matches by its final directory name.
    assert settings.decide("/models/my-llama/").convert
    excluded = settings.decide("meta/other")
    assert not excluded.convert and "not in allowlist" in str(excluded)


def test_config_file_rules_first_match_wins_and_env_overrides(tmp_path, monkeypatch):
    config = write(
        tmp_path,
        "embed.toml",
        """
        format = "int8"
        models = ["*"]

        [[rules]]
        match = "*small*"
        format = "off"

        [[rules]]
        match = "*"
        group_size = 64
        """,
    )
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(config))
    settings = load_settings()
    assert not settings.decide("org/very-small").convert
    big = settings.decide("org/big")
    assert (big.format, big.group_size) == ("int8", 64)
    assert "rule 2" in big.reason
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "off")
    assert load_settings().format == "off"


def test_importance_file_per_rule_or_global(tmp_path, monkeypatch):
    a, b = write(tmp_path, "a.safetensors", "x"), write(tmp_path, "b.safetensors", "x")
    config = write(
        tmp_path,
        "embed.toml",
        f"""
        format = "int4"
        importance = "{a}"

        [[rules]]
        match = "draft-*"
        importance = "{b}"
        """,
    )
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(config))
    settings = load_settings()
    assert settings.decide("/m/draft-1").importance == b
    target = settings.decide("/m/target")
    assert target.importance == a and f"importance {a}" in str(target)


def test_head_format_is_independent_of_format_and_set_per_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_EMBED_HEAD_FORMAT", "int8")
    alone = load_settings()
    assert alone.active and alone.format == "off"
    decision = alone.decide("org/m")
    assert (decision.convert, decision.convert_head, decision.head_format) == (False, True, "int8")
    assert "embedding off, untied LM head int8" in str(decision)
    assert "head_format=int8" in alone.summary()
    monkeypatch.delenv("VLLM_EMBED_HEAD_FORMAT")
    config = write(
        tmp_path,
        "embed.toml",
        """
        format = "int8"

        [[rules]]
        match = "big-*"
        head_format = "int5"
        """,
    )
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(config))
    settings = load_settings()
    big, small = settings.decide("/m/big-1"), settings.decide("/m/small")
    assert (big.format, big.head_format) == ("int8", "int5")
    assert (small.format, small.head_format, small.convert_head) == ("int8", "off", False)
    assert str(small) == "model '/m/small': int8 (default format)"


def test_yaml_config(tmp_path, monkeypatch):
    config = write(tmp_path, "embed.yaml", "format: int8\nmodels: [a, b]\n")
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(config))
    assert load_settings().models == ["a", "b"]


@pytest.mark.parametrize(
    "env, file_text, expected",
    [
        ({"VLLM_EMBED_FORMAT": "int9"}, None, ["VLLM_EMBED_FORMAT='int9'", "'off'", "'int8'"]),
        ({"VLLM_EMBED_GROUP_SIZE": "33"}, None, ["VLLM_EMBED_GROUP_SIZE=33", "32", "'row'"]),
        ({"VLLM_EMBED_FROMAT": "int8"}, None, ["VLLM_EMBED_FROMAT", "VLLM_EMBED_FORMAT"]),
        ({}, 'format = "int8"\ncolour = "red"\n', ["colour", "unknown key", "format"]),
        (
            {},
            '[[rules]]\nmatch = "x"\nformatt = "int8"\n',
            ["rules.0.formatt", "unknown key", "match"],
        ),
        ({}, 'format = "int4x"\n', ["format='int4x'", "'int8'"]),
        ({}, "format = int8\n", ["malformed TOML"]),
        (
            {"VLLM_EMBED_HEAD_KERNEL": "marlin"},
            None,
            ["VLLM_EMBED_HEAD_KERNEL='marlin'", "'auto'", "'plugin'", "'machete'"],
        ),
        (
            {"VLLM_EMBED_HEAD_FORMAT": "int3"},
            None,
            ["VLLM_EMBED_HEAD_FORMAT='int3'", "'off'", "'int8'", "'int4'"],
        ),
        (
            {"VLLM_EMBED_HEAD_FORMAT": "host-int8"},
            None,
            ["VLLM_EMBED_HEAD_FORMAT='host-int8'", "must stay on the GPU", "'off', 'int8'"],
        ),
        ({}, '[[rules]]\nmatch = "x"\nhead_format = "host"\n', ["rules.0.head_format='host'"]),
        (
            {"VLLM_EMBED_IMPORTANCE": "/nonexistent/m.safetensors"},
            None,
            ["VLLM_EMBED_IMPORTANCE='/nonexistent/m.safetensors'", "not point to a file"],
        ),
    ],
)
def test_bad_input_names_setting_value_and_allowed(tmp_path, monkeypatch, env, file_text, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if file_text is not None:
        monkeypatch.setenv("VLLM_EMBED_CONFIG", str(write(tmp_path, "c.toml", file_text)))
    with pytest.raises(EmbedSettingsError) as info:
        load_settings()
    message = str(info.value)
    for part in expected:
        assert part in message, message
    assert "\n" not in message


def test_missing_and_unreadable_config(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(EmbedSettingsError, match="no such file"):
        load_settings()
    directory = tmp_path / "dir.toml"
    directory.mkdir()
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(directory))
    with pytest.raises(EmbedSettingsError, match="VLLM_EMBED_CONFIG"):
        load_settings()


def test_every_documented_variable_is_accepted(monkeypatch):
    """Variables read outside the settings (the model cache, the kernels' torch-path switch)
    must not trip the unknown-variable check, which would stop vLLM."""
    monkeypatch.setenv("VLLM_EMBED_NO_TRITON", "1")
    monkeypatch.setenv("VLLM_EMBED_CACHE", "/tmp/models")
    monkeypatch.setenv("VLLM_EMBED_UNTESTED_VLLM", "off")
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    settings = load_settings()
    assert settings.format == "int8" and settings.untested_vllm == "off"


def test_documented_variables_match_what_is_accepted():
    """Every VLLM_EMBED_* named in the package's sources or the README is accepted."""
    import re
    from pathlib import Path

    import vllm_embed_plugin
    from vllm_embed_plugin.settings import ENV_PREFIX, OTHER_ENV, EmbedSettings

    root = Path(vllm_embed_plugin.__file__).parent
    texts = [p.read_text() for p in root.rglob("*.py")]
    readme = root.parent / "README.md"
    if readme.exists():
        texts.append(readme.read_text())
    named = {m for text in texts for m in re.findall(r"\bVLLM_EMBED_[A-Z_]*[A-Z]\b", text)}
    accepted = {ENV_PREFIX + f.upper() for f in EmbedSettings.model_fields} | OTHER_ENV
    assert named and named <= accepted, named - accepted


def test_rejected_variable_names_what_is_allowed(monkeypatch):
    monkeypatch.setenv("VLLM_EMBED_NO_TRITONS", "1")
    with pytest.raises(EmbedSettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("unknown setting VLLM_EMBED_NO_TRITONS; allowed are ")
    for name in (
        "VLLM_EMBED_FORMAT",
        "VLLM_EMBED_NO_TRITON",
        "VLLM_EMBED_CACHE",
        "VLLM_EMBED_UNTESTED_VLLM",
    ):
        assert name in message


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    import sys

    config = write(tmp_path, "embed.yaml", "format: int8\n")
    monkeypatch.setenv("VLLM_EMBED_CONFIG", str(config))
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    with pytest.raises(
        EmbedSettingsError, match=r"needs PyYAML \(pip install 'vllm-embed-plugin\[yaml\]'\)"
    ):
        load_settings()


def test_vllm_knows_the_plugin_variables_once_registered(monkeypatch):
    """vLLM's own check of VLLM_* variables (the one that logs "Unknown vLLM environment
    variable detected") passes for the plugin's variables once register() has run."""
    import os

    from vllm import envs
    from vllm.platforms import current_platform

    import vllm_embed_plugin

    # vLLM 0.32 checks on the platform, 0.26 in vllm.envs; both read this table.
    validate = getattr(current_platform, "validate_environ", None) or envs.validate_environ
    # vLLM's table as it is before any register() (an earlier test may have run one).
    vllm_own = {
        k: v for k, v in envs.environment_variables.items() if not k.startswith("VLLM_EMBED_")
    }
    monkeypatch.setattr(envs, "environment_variables", vllm_own)
    for key in list(os.environ):
        if key.startswith("VLLM_") and key not in envs.environment_variables:
            monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "off")
    monkeypatch.setenv("VLLM_EMBED_MODELS", "some-model")
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_EMBED"):
        validate(hard_fail=True)
    vllm_embed_plugin.register()
    vllm_embed_plugin.register()  # again, as vLLM may: harmless
    validate(hard_fail=True)
    assert envs.environment_variables["VLLM_EMBED_MODELS"]() == "some-model"
    assert "VLLM_EMBED_NO_TRITON" in envs.environment_variables
