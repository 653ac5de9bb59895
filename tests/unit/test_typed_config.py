"""Strict dict -> dataclass conversion and Hydra composition errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import pytest

from moerl.config import compose, load_model_config
from moerl.typed_config import ConfigError, from_dict, to_dict


@dataclass
class Inner:
    rate: float = 0.1
    mode: Literal["a", "b"] = "a"


@dataclass
class Outer:
    steps: int = 1
    name: str | None = None
    inner: Inner = field(default_factory=Inner)
    sizes: list[int] = field(default_factory=list)


def test_round_trip() -> None:
    cfg = Outer(steps=3, name="x", inner=Inner(rate=2.0, mode="b"), sizes=[1, 2])
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_int_widens_to_float() -> None:
    assert from_dict(Inner, {"rate": 1}).rate == 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stepz": 1}, r"stepz: unknown key"),
        ({"steps": "3"}, r"steps: expected an integer"),
        ({"steps": True}, r"steps: expected an integer"),
        ({"inner": {"mode": "c"}}, r"inner\.mode: 'c' is not one of"),
        ({"inner": {"rat": 1.0}}, r"inner\.rat: unknown key"),
        ({"sizes": [1, "x"]}, r"sizes\[1\]: expected an integer"),
        ({"inner": 3}, r"inner: expected a mapping"),
    ],
)
def test_errors_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_hydra_override_of_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"model\.bogus"):
        compose(["model.bogus=1"])


def test_hydra_unknown_group_option_lists_options() -> None:
    with pytest.raises(ConfigError, match="kimi-k2"):
        compose(["model=nope"])


def test_appended_unknown_key_fails_the_schema() -> None:
    with pytest.raises(ConfigError, match=r"model\.bogus: unknown key"):
        load_model_config(["+model.bogus=1"])


def test_override_reaches_the_typed_config() -> None:
    arch, _ = load_model_config(["model=kimi-k2", "model.num_layers=5"])
    assert arch.name == "kimi-k2" and arch.num_layers == 5


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclass
class WithEnum:
    mode: Mode = Mode.FAST


def test_enum_fields_take_their_values() -> None:
    assert from_dict(WithEnum, {"mode": "slow"}).mode is Mode.SLOW
    assert to_dict(WithEnum(Mode.SLOW)) == {"mode": "slow"}
    with pytest.raises(ConfigError, match=r"mode: 'medium' is not one of 'fast', 'slow'"):
        from_dict(WithEnum, {"mode": "medium"})
