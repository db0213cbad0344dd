"""The parsing every config section shares: errors that name the key and the fix, type coercion of JSON
values against a section's type hints, and ``_Section`` (key checks, aliases, keys rayzero rejects as
not supported yet, ``to_dict``).  The sections themselves live in ``rayzero.config``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key, the value and the fix."""


class NotSupportedYetError(ConfigError):
    """A valid DeepSpeed key for a capability rayzero does not have yet."""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def did_you_mean(key: str, candidates: typing.Iterable[str]) -> str:
    """"; did you mean 'x'?" for the closest candidate, or "" when none is close."""
    match = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def unknown_key_error(path: str, key: str, known: typing.Iterable[str]) -> ConfigError:
    """ConfigError for an unknown key at dotted `path`, suggesting the closest of `known`."""
    known = sorted(known)
    hint = did_you_mean(key, known)
    if not hint:
        hint = f"; known keys here: {', '.join(known)}" if known else ""
    return ConfigError(f"unknown config key '{path}'{hint}")


def not_supported_error(path: str, what: str = "") -> NotSupportedYetError:
    detail = f" ({what})" if what else ""
    return NotSupportedYetError(
        f"config key '{path}'{detail} is not supported yet by rayzero; remove it from the config "
        "to train without it"
    )


_TYPE_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def _type_error(path: str, value: Any, expected: str) -> ConfigError:
    hint = ""
    if value == "auto":
        hint = " ('auto' is a Hugging Face Trainer placeholder; write the concrete value)"
    return ConfigError(
        f"config key '{path}' has value {value!r} of type {type(value).__name__}; expected {expected}{hint}"
    )


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against type hint `tp`; return it normalised (5e8 -> 500000000, dict -> section)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(path, value, inner[0])
        raise TypeError(f"unsupported config type hint {tp!r}")  # programming error, not user error
    if isinstance(tp, type) and issubclass(tp, _Section):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return tp.from_dict(value)
        raise _type_error(path, value, f"a mapping of {tp.__name__} keys")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, value, _TYPE_WORDS[bool])
    if tp is int:
        if isinstance(value, bool):
            raise _type_error(path, value, _TYPE_WORDS[int])
        if isinstance(value, int):
            return value
        # DeepSpeed configs write sizes as 5e8; accept floats that are whole numbers.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _type_error(path, value, _TYPE_WORDS[int])
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(path, value, _TYPE_WORDS[float])
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, value, _TYPE_WORDS[str])
    if tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return copy.deepcopy(list(value))
        raise _type_error(path, value, "a list")
    if tp is dict or origin is dict:
        if isinstance(value, Mapping):
            return copy.deepcopy(dict(value))
        raise _type_error(path, value, _TYPE_WORDS[dict])
    raise TypeError(f"unsupported config type hint {tp!r}")


class _Section:
    """Shared parsing for config dataclasses: key checks in from_dict, type checks in __post_init__."""

    _path: ClassVar[str] = ""
    # DeepSpeed keys for capabilities not built yet -> short description.
    _not_supported: ClassVar[Mapping[str, str]] = {}
    # Other accepted spellings -> field name.
    _aliases: ClassVar[Mapping[str, str]] = {}
    # Keys accepted only with one value, because rayzero always behaves that way: key -> (value, why).
    _fixed: ClassVar[Mapping[str, tuple[Any, str]]] = {}

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        if not isinstance(data, Mapping):
            raise _type_error(cls._path or "<config>", data, f"a mapping of {cls.__name__} keys")
        names = cls._field_names()
        kwargs: dict[str, Any] = {}
        source: dict[str, str] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"config key {key!r} under '{cls._path or '<top level>'}' is not a string")
            path = _join(cls._path, key)
            name = key if key in names else cls._aliases.get(key)
            if name is not None:
                if name in kwargs:
                    raise ConfigError(
                        f"config keys '{_join(cls._path, source[name])}' and '{path}' set the same "
                        "option; keep one"
                    )
                kwargs[name] = value
                source[name] = key
            elif key in cls._fixed:
                want, why = cls._fixed[key]
                got = _coerce(path, value, type(want))
                if got != want:
                    raise ConfigError(f"config key '{path}' = {value!r} is not supported: {why}; set it to {want!r} or remove it")
            elif key in cls._not_supported:
                raise not_supported_error(path, cls._not_supported[key])
            else:
                supported = [*names, *cls._aliases, *cls._fixed]
                err = unknown_key_error(path, key, supported)
                if "did you mean" not in str(err):
                    near = did_you_mean(key, cls._not_supported)
                    if near:
                        err = ConfigError(f"unknown config key '{path}'{near} (that key is not supported yet)")
                raise err
        required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        for name in required:
            if name not in kwargs:
                raise ConfigError(f"config key '{_join(cls._path, name)}' is required")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(_join(self._path, f.name), value, hints[f.name]))
        self._validate()

    def _validate(self) -> None:
        pass

    def _check(self, name: str, ok: bool, requirement: str) -> None:
        if not ok:
            value = getattr(self, name)
            raise ConfigError(f"config key '{_join(self._path, name)}' = {value!r} is invalid: {requirement}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with DeepSpeed key names; `from_any(x.to_dict())` rebuilds an equal config."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Section) else copy.deepcopy(value)
        return out
