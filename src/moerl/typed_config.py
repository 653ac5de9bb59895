"""Plain data (from Hydra/YAML) -> typed dataclasses, strictly.

Hydra composes YAML into a DictConfig; the entry point converts it here at once,
so an unknown key or a wrong type fails at start-up with the dotted path of the
field, and nothing deeper ever sees a dict. OmegaConf's own structured configs
cannot express `Literal` or `int | None` unions, which the schemas use.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config value that does not fit its schema; the message names the field."""


def from_dict[T](cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping for {cls.__name__}, "
                          f"got {type(data).__name__}")
    assert dataclasses.is_dataclass(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key for {cls.__name__}; known keys: "
            f"{', '.join(sorted(fields))}"
        )
    hints = {**get_type_hints(cls), **_dependent_types(cls, data, path)}
    values: dict[str, Any] = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, _join(path, name))
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as err:  # a schema's own check
        raise _named(path, err) from err
    except TypeError as err:
        raise ConfigError(f"{path or 'config'}: {err}") from err


def defaults_of(cls: type) -> dict[str, Any]:
    """The fields of dataclass `cls` that have defaults, as plain data (a nested group:
    its own defaults): what a YAML file of that group need not repeat. A field whose type
    another field chooses (`field_types`) starts empty, for the chosen class to fill."""
    assert dataclasses.is_dataclass(cls)
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in _open_fields(cls):
            out[f.name] = {}
        elif f.default is not dataclasses.MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _plain(f.default_factory())
        elif dataclasses.is_dataclass(hints[f.name]):  # a required group
            out[f.name] = defaults_of(typing.cast(type, hints[f.name]))
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        open_fields = _open_fields(type(value))
        return {f.name: {} if f.name in open_fields else _plain(getattr(value, f.name))
                for f in dataclasses.fields(value) if f.init}
    return to_dict(value)


def _open_fields(cls: type) -> set[str]:
    chooser = getattr(cls, "field_types", None)
    return set(chooser({})) if chooser is not None else set()


def _dependent_types(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    """Types of fields that other fields choose: a dataclass may define
    `field_types(data) -> {name: type}` (e.g. the `rl` group types `objective_args` by
    `objective`); a ValueError there names the choosing field."""
    chooser = getattr(cls, "field_types", None)
    if chooser is None:
        return {}
    try:
        chosen: dict[str, Any] = chooser(data)
    except ValueError as err:
        raise _named(path, err) from err
    return chosen


def _named(path: str, err: ValueError) -> ConfigError:
    """A schema's own error; prefixed with the field's path unless the message names it."""
    message = str(err)
    return ConfigError(message if not path or path in message else f"{path}: {message}")


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (for logging, hashing and writing next to checkpoints)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _join(path: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{path}[{name}]"
    return f"{path}.{name}" if path else name


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        (item_type, *_) = get_args(tp) or (Any,)
        items = [_convert(item_type, v, _join(path, i)) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        _, value_type = get_args(tp) or (Any, Any)
        return {k: _convert(value_type, v, _join(path, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(typing.cast(type, tp), value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            members = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{path}: {value!r} is not one of {members}") from None
    return _convert_scalar(tp, value, path)


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    options = get_args(tp)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{path}: may not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert(option, value, path)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {tp}")


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: must be null")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported schema type {tp!r}")
