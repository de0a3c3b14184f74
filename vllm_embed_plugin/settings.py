"""The plugin's whole public configuration: typed settings and the per-model decision.

Settings come from `VLLM_EMBED_*` environment variables and, optionally, a TOML or YAML file
named by `VLLM_EMBED_CONFIG` (same settings under lower-case keys, plus `[[rules]]`).
Environment variables override the file. Anything unknown or malformed raises
`EmbedSettingsError` with one message naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FilePath, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from .formats import FORMATS, GROUP_SIZES, HOST_FORMATS

ENV_PREFIX = "VLLM_EMBED_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: Variables under the prefix that are not settings of the engine, read elsewhere:
#: the tools' cache directory (tools/__init__.py) and the switches that force the torch paths
#: and direct head launches (kernels/__init__.py, which reads os.environ itself and never
#: imports the settings).
OTHER_ENV = {ENV_PREFIX + "CACHE", ENV_PREFIX + "NO_TRITON", ENV_PREFIX + "NO_HEAD_GRAPHS"}

FormatName = Literal[("off", *FORMATS, *HOST_FORMATS)]  # type: ignore[valid-type]
DeviceFormatName = Literal[("off", *FORMATS)]  # type: ignore[valid-type]
GroupSize = Literal[GROUP_SIZES]  # type: ignore[valid-type]


class EmbedSettingsError(ValueError):
    """A setting is wrong; vLLM must not start."""


def _numeric_group(value: Any) -> Any:
    """Environment variables are strings: "64" means the group size 64."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _device_head_format(value: Any) -> Any:
    """The head is read in full at every step, so it cannot live in host memory."""
    if value in HOST_FORMATS:
        allowed = ", ".join(repr(name) for name in ("off", *FORMATS))
        raise ValueError(
            f"a host format keeps a table in host memory, but the LM head is read in full at "
            f"every step and must stay on the GPU; allowed are {allowed}"
        )
    return value


def _split_patterns(value: Any) -> Any:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    return value


class ModelRule(BaseModel):
    """One `[[rules]]` entry: the first rule whose `match` fits a model decides for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str = Field(description="glob pattern on the model name (or its final directory name)")
    format: FormatName | None = None
    head_format: DeviceFormatName | None = None
    group_size: GroupSize | None = None
    tied_fallback: DeviceFormatName | None = None
    importance: FilePath | None = None

    _numeric_group = field_validator("group_size", mode="before")(_numeric_group)
    _device_head = field_validator("head_format", mode="before")(_device_head_format)


class EmbedSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    format: FormatName = Field("off", description="storage format of the token-embedding table")
    head_format: DeviceFormatName = Field(
        "off",
        description="storage format of an untied LM head (the target's or a separate draft "
        "model's), independent of `format`; a tied head is the embedding table and follows "
        "`format`",
    )
    group_size: GroupSize | None = Field(
        None, description="columns per scale; unset = the format's measured default"
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="allowlist of glob patterns on the model name; empty = every model",
    )
    rules: list[ModelRule] = Field(default_factory=list, description="per-model overrides")
    tied_fallback: DeviceFormatName | None = Field(
        None,
        description="format for a model whose LM head is tied, when `format` is a host format "
        "(which a tied head cannot use); unset = such a model stops startup with an error",
    )
    importance: FilePath | None = Field(
        None,
        description="column-importance file from `vllm-embed-plugin calibrate` for this model; "
        "the scale search then weighs each column by it (unset = the formats' plain rules)",
    )
    head_kernel: Literal["auto", "plugin", "machete"] = Field(
        "plugin",
        description="kernel of an LM head tied to a converted table: 'machete' stores the table "
        "in the layout of vLLM's Machete GEMM (Hopper; symmetric int4/int8, groups of 64 or "
        "128) and computes the logits there, 'plugin' keeps the plugin's own kernels, 'auto' "
        "takes Machete wherever it can serve the table",
    )
    on_error: Literal["fail", "keep"] = Field(
        "fail",
        description="a table that cannot be converted: 'fail' stops startup, 'keep' serves it in BF16",
    )
    untested_vllm: Literal["warn", "off"] = Field(
        "warn",
        description="a vLLM newer than the newest tested release: 'warn' acts on it with one "
        "warning, 'off' leaves the plugin inactive there",
    )
    config: Path | None = Field(None, description="TOML or YAML file with these settings")

    _split_models = field_validator("models", mode="before")(_split_patterns)
    _numeric_group = field_validator("group_size", mode="before")(_numeric_group)
    _device_head = field_validator("head_format", mode="before")(_device_head_format)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            return (init_settings, env_settings)
        return (init_settings, env_settings, _file_source(settings_cls, Path(path)))

    @property
    def active(self) -> bool:
        """False when nothing could ever be converted: the plugin then changes nothing."""
        return any(
            value not in (None, "off")
            for value in (
                self.format,
                self.head_format,
                *(r.format for r in self.rules),
                *(r.head_format for r in self.rules),
            )
        )

    def decide(self, model: str) -> Decision:
        """Which format this model's embedding gets, and why (for the log)."""
        if self.models and not any(_matches(p, model) for p in self.models):
            return Decision(model, "off", None, "not in allowlist, untouched")
        for number, rule in enumerate(self.rules, start=1):
            if _matches(rule.match, model):
                return Decision(
                    model,
                    rule.format or self.format,
                    rule.group_size or self.group_size,
                    f"rule {number} (match {rule.match!r})",
                    rule.tied_fallback or self.tied_fallback,
                    rule.importance or self.importance,
                    rule.head_format or self.head_format,
                )
        return Decision(
            model,
            self.format,
            self.group_size,
            "default format",
            self.tied_fallback,
            self.importance,
            self.head_format,
        )

    def summary(self) -> str:
        parts = [f"format={self.format}"]
        if self.head_format != "off":
            parts.append(f"head_format={self.head_format}")
        if self.group_size:
            parts.append(f"group_size={self.group_size}")
        parts.append(f"models={','.join(self.models) or '*'}")
        if self.importance:
            parts.append(f"importance={self.importance}")
        if self.head_kernel != "plugin":
            parts.append(f"head_kernel={self.head_kernel}")
        parts.append(f"on_error={self.on_error}")
        if self.untested_vllm != "warn":
            parts.append(f"untested_vllm={self.untested_vllm}")
        if self.rules:
            parts.append(f"rules={len(self.rules)}")
        if self.config:
            parts.append(f"config={self.config}")
        return " ".join(parts)


@dataclass(frozen=True)
class Decision:
    model: str
    format: str
    group_size: int | str | None
    reason: str
    tied_fallback: str | None = None
    #: Column-importance file for the scale search, or None.
    importance: Path | None = None
    #: Format of an untied LM head ("off": vLLM's own BF16 head).
    head_format: str = "off"

    @property
    def convert(self) -> bool:
        """Whether the embedding table is converted."""
        return self.format != "off"

    @property
    def convert_head(self) -> bool:
        """Whether an untied LM head is converted."""
        return self.head_format != "off"

    @property
    def on_host(self) -> bool:
        return self.format in HOST_FORMATS

    def __str__(self) -> str:
        if not (self.convert or self.convert_head):
            return f"model {self.model!r}: {self.reason}"
        group = f", group {self.group_size}" if self.group_size else ""
        weighted = f", importance {self.importance}" if self.importance else ""
        formats = self.format
        if self.convert_head:
            formats = f"embedding {self.format}, untied LM head {self.head_format}"
        return f"model {self.model!r}: {formats}{group}{weighted} ({self.reason})"


def _matches(pattern: str, model: str) -> bool:
    name = model.rstrip("/")
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(
        os.path.basename(name), pattern
    )


def _file_source(settings_cls, path: Path) -> PydanticBaseSettingsSource:
    if not path.exists():
        raise EmbedSettingsError(f"{CONFIG_ENV}={str(path)!r}: no such file")
    if not path.is_file():
        raise EmbedSettingsError(f"{CONFIG_ENV}={str(path)!r}: not a file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise EmbedSettingsError(
            f"{CONFIG_ENV}={str(path)!r}: cannot read it ({exc.strerror})"
        ) from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # noqa: F401
        except ImportError:
            raise EmbedSettingsError(
                f"{CONFIG_ENV}={str(path)!r}: a YAML file needs PyYAML "
                "(pip install 'vllm-embed-plugin[yaml]'), or write the file in TOML"
            ) from None
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EmbedSettingsError(f"{CONFIG_ENV}={str(path)!r}: malformed TOML ({exc})") from None
    return TomlConfigSettingsSource(settings_cls, toml_file=path)


def _setting_name(loc: tuple, config: str | None) -> str:
    """Name a setting as the user wrote it: the variable if set, else the file key."""
    env_name = ENV_PREFIX + str(loc[0]).upper()
    if env_name in os.environ:
        return env_name
    key = ".".join(str(part) for part in loc)
    return f"{config}: {key}" if config else key


def _describe(error: dict, config: str | None) -> str:
    name = _setting_name(error["loc"], config)
    if error["type"] == "extra_forbidden":
        parent = EmbedSettings if len(error["loc"]) == 1 else ModelRule
        allowed = ", ".join(parent.model_fields)
        return f"{name}: unknown key; allowed keys are {allowed}"
    return f"{name}={error['input']!r}: {error['msg']}"


def env_names() -> set[str]:
    """Every environment variable the plugin reads."""
    return {ENV_PREFIX + field.upper() for field in EmbedSettings.model_fields} | OTHER_ENV


def _check_unknown_env() -> None:
    known = env_names()
    unknown = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise EmbedSettingsError(
            f"unknown setting {', '.join(unknown)}; allowed are {', '.join(sorted(known))}"
        )


def load_settings() -> EmbedSettings:
    """Read and validate the settings now (raises EmbedSettingsError)."""
    _check_unknown_env()
    try:
        return EmbedSettings()
    except ValidationError as exc:
        config = os.environ.get(CONFIG_ENV)
        lines = [_describe(error, config) for error in exc.errors()]
        raise EmbedSettingsError(
            "invalid vllm-embed-plugin settings: " + "; ".join(lines)
        ) from None
    except (ValueError, OSError) as exc:
        if isinstance(exc, EmbedSettingsError):
            raise
        raise EmbedSettingsError(f"{CONFIG_ENV}: {exc}") from None


@functools.cache
def current_settings() -> EmbedSettings:
    """The settings of this process, read once."""
    return load_settings()
