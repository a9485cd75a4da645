from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from gpuslice_core import strict


class ConfigError(ValueError):
    pass


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    devices: Literal["all"] | list[int]
    mig_enabled: bool = Field(alias="mig-enabled")


class Layouts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal["v1"]
    configs: dict[str, list[Device]]


def parse(text: str) -> Layouts:
    return strict.decode(
        Layouts,
        strict.load_yaml(text, source="l.yaml", error=ConfigError),
        source="l.yaml",
        error=ConfigError,
    )


def test_unknown_key_deep_in_maps_and_lists_lists_the_allowed_keys() -> None:
    text = (
        "version: v1\n"
        "configs:\n"
        "  a:\n"
        "    - devices: all\n"
        "      mig-enabled: true\n"
        "      migenabled: 1\n"
    )
    with pytest.raises(ConfigError) as err:
        parse(text)
    assert str(err.value) == (
        "l.yaml: configs.a[0].migenabled: unknown key; allowed keys here: devices, mig-enabled"
    )


def test_union_alternatives_are_one_message_with_the_value() -> None:
    text = "version: v1\nconfigs:\n  a:\n    - devices: some\n      mig-enabled: true\n"
    with pytest.raises(ConfigError, match=r"configs\.a\[0\]\.devices: .*'all'.* \(got 'some'\)"):
        parse(text)


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'version'"):
        parse("version: v1\nversion: v1\nconfigs: {}\n")


def test_missing_and_unreadable() -> None:
    with pytest.raises(ConfigError, match="configs: required key is missing"):
        parse("version: v1\n")
    with pytest.raises(ConfigError, match="cannot read layouts /nonexistent"):
        strict.read_text("/nonexistent", what="layouts", error=ConfigError)
