"""The parsing every config section shares: errors that name the key and the fix, type coercion of JSON
values against a section's type hints, and ``_Section`` (key checks, aliases, keys rayzero rejects as
not supported yet, DeepSpeed keys accepted because they have no effect at their value, ``to_dict``).
The sections themselves live in ``rayzero.config``.

Loading collects every problem of a config before it raises: one ``ConfigError`` (a
``NotSupportedYetError`` when every problem is a not-supported key) lists each key, its problem and its
fix.  The keys accepted as inert are named in one warning per load (logger ``rayzero``).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import json
import logging
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

logger = logging.getLogger("rayzero")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key, the value and the fix.

    ``problems`` holds one error per problem: a config with several problems raises one error listing them
    all (its ``problems`` are the single errors); a config with one raises that error itself."""

    @property
    def problems(self) -> list[ConfigError]:
        return getattr(self, "_problems", None) or [self]


class NotSupportedYetError(ConfigError):
    """A valid DeepSpeed key for a capability rayzero does not have yet."""


def combine_problems(problems: typing.Sequence[ConfigError]) -> ConfigError:
    """One error for all ``problems`` (each flattened): the error itself when there is one, else an error
    listing them, a ``NotSupportedYetError`` when all of them are."""
    flat: list[ConfigError] = []
    for p in problems:
        for q in p.problems:
            if str(q) not in (str(f) for f in flat):
                flat.append(q)
    if len(flat) == 1:
        return flat[0]
    cls = NotSupportedYetError if all(isinstance(p, NotSupportedYetError) for p in flat) else ConfigError
    lines = "\n".join(f"  - {p}" for p in flat)
    err = cls(f"the config has {len(flat)} problems; fix all of them before training:\n{lines}")
    err._problems = flat
    return err


@dataclasses.dataclass(frozen=True)
class Inert:
    """A DeepSpeed key rayzero accepts where it has no effect: ``when(value)`` says whether ``value`` is such a
    value (``why`` says why, in the notice); any other value is refused as not supported yet (``refuse``
    names what that value would ask for)."""

    why: str
    when: Callable[[Any], bool] = lambda value: True
    refuse: str = ""
    fix: str = "remove it from the config to train without it"


def inert_at(*values: Any, why: str, refuse: str = "") -> Inert:
    """A key inert at ``values`` only (``False`` matches only ``False``, not ``0``)."""
    def when(value: Any) -> bool:
        for v in values:
            if isinstance(v, bool) or isinstance(value, bool) or v is None:
                if value is v:
                    return True
            elif value == v:
                return True
        return False

    return Inert(why=why, when=when, refuse=refuse, fix=f"set it to {json.dumps(values[0])} or remove it")


def _section_off(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is False


def inert_when_disabled(refuse: str) -> Inert:
    """A section inert while ``"enabled": false`` (whatever else it sets); refused when enabled."""
    return Inert(why="\"enabled\" is false", when=_section_off, refuse=refuse,
                 fix="set \"enabled\": false or remove the section")


# (path, value, why) of each key accepted as inert during the config load in progress; None outside a load
_INERT_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("rayzero_inert_keys", default=None)


def note_inert(path: str, value: Any, why: str) -> None:
    """Record a key accepted as inert for the load in progress' notice (nothing outside a load)."""
    seen = _INERT_SEEN.get()
    if seen is not None:
        seen.append((path, value, why))


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return os.environ.get("RANK", "0") == "0"


def inert_notice(seen: typing.Sequence[tuple[str, Any, str]]) -> str:
    keys = "; ".join(f"{path} = {value!r} ({why})" for path, value, why in seen)
    return (f"rayzero: {len(seen)} DeepSpeed config key(s) accepted with no effect at their values: {keys}. "
            "Remove them to silence this notice; docs/config.md lists how rayzero reads every DeepSpeed key")


def _auto_paths(path: str, value: Any) -> list[str]:
    """Dotted paths of the ``"auto"`` leaves in a plain JSON value (Hugging Face Trainer placeholders)."""
    if isinstance(value, str):
        return [path] if value == "auto" else []
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _auto_paths(_join(path, str(k)), v)]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _auto_paths(f"{path}[{i}]", v)]
    return []


def auto_error(path: str) -> ConfigError:
    return ConfigError(
        f"config key '{path}' is 'auto', a Hugging Face Trainer placeholder (the Trainer writes the value before "
        "DeepSpeed reads the config); write the concrete value"
    )


AUTO_DEFAULT = "DeepSpeed reads \"auto\" in this section as the key's default; rayzero's default applies"


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


_NO_VALUE = object()


def not_supported_error(path: str, what: str = "", value: Any = _NO_VALUE,
                        fix: str = "remove it from the config to train without it") -> NotSupportedYetError:
    detail = f" ({what})" if what else ""
    shown = "" if value is _NO_VALUE else f" = {value!r}"
    return NotSupportedYetError(f"config key '{path}'{shown}{detail} is not supported yet by rayzero; {fix}")


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


def _is_section_hint(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return any(_is_section_hint(a) for a in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, _Section)


def _accepts_str(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return tp is str


class _Section:
    """Shared parsing for config dataclasses: key checks in from_dict, type checks in __post_init__."""

    _path: ClassVar[str] = ""
    # DeepSpeed keys for capabilities not built yet -> short description.
    _not_supported: ClassVar[Mapping[str, str]] = {}
    # Other accepted spellings -> field name.
    _aliases: ClassVar[Mapping[str, str]] = {}
    # Keys accepted only with one value, because rayzero always behaves that way: key -> (value, why).
    _fixed: ClassVar[Mapping[str, tuple[Any, str]]] = {}
    # DeepSpeed keys accepted where they have no effect (named in the load's notice), refused elsewhere.
    _inert: ClassVar[Mapping[str, Inert]] = {}
    # keys that belong in another section (DeepSpeed refuses them here too) -> where they go
    _misplaced: ClassVar[Mapping[str, str]] = {}
    # True for the sections DeepSpeed reads with its pydantic models, which drop a key written "auto" (so it
    # takes its default): rayzero reads such a key as its own default, named in the load's notice
    _auto_means_default: ClassVar[bool] = False
    # path -> value of the keys the last from_dict accepted as inert (set on the section it returned)
    ignored_keys: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """The section from DeepSpeed-style keys; every problem of ``data`` (and of its sub-sections) is
        reported in one ``ConfigError``; keys accepted as inert are named in one warning per load."""
        outer = _INERT_SEEN.get() is None
        token = _INERT_SEEN.set([]) if outer else None
        try:
            obj = cls._from_dict(data)
            seen = list(_INERT_SEEN.get() or ())
        finally:
            if token is not None:
                _INERT_SEEN.reset(token)
        if outer:
            object.__setattr__(obj, "ignored_keys", {path: value for path, value, _ in seen})
            if seen and _is_rank0():
                logger.warning(inert_notice(seen))
        return obj

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]):
        if not isinstance(data, Mapping):
            raise _type_error(cls._path or "<config>", data, f"a mapping of {cls.__name__} keys")
        data = cls._translate(dict(data))
        names = cls._field_names()
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        source: dict[str, str] = {}
        problems: list[ConfigError] = []
        for key, value in data.items():
            if not isinstance(key, str):
                problems.append(
                    ConfigError(f"config key {key!r} under '{cls._path or '<top level>'}' is not a string"))
                continue
            path = _join(cls._path, key)
            try:
                name = key if key in names else cls._aliases.get(key)
                if name is not None:
                    if name in source:
                        raise ConfigError(
                            f"config keys '{_join(cls._path, source[name])}' and '{path}' set the same "
                            "option; keep one"
                        )
                    source[name] = key
                    hint = hints[name]
                    if isinstance(value, str) and value == "auto" and not _accepts_str(hint):
                        if cls._auto_means_default:
                            note_inert(path, value, AUTO_DEFAULT)
                        else:
                            problems.append(auto_error(path))
                        continue
                    if isinstance(value, Mapping) and not _is_section_hint(hint):  # free-form (params)
                        autos = _auto_paths(path, value)
                        if autos:
                            problems.extend(auto_error(p) for p in autos)
                            continue
                    kwargs[name] = _coerce(path, value, hints[name])
                elif key in cls._fixed:
                    want, why = cls._fixed[key]
                    got = _coerce(path, value, type(want))
                    if got != want:
                        raise ConfigError(f"config key '{path}' = {value!r} is not supported: {why}; set it to {want!r} or remove it")
                elif key in cls._inert:
                    rule = cls._inert[key]
                    if isinstance(value, str) and value == "auto":
                        if not cls._auto_means_default:
                            raise auto_error(path)
                        note_inert(path, value, AUTO_DEFAULT)
                        continue
                    if not rule.when(value):
                        raise not_supported_error(path, rule.refuse, value=value, fix=rule.fix)
                    note_inert(path, value, rule.why)
                elif key in cls._not_supported:
                    raise not_supported_error(path, cls._not_supported[key])
                elif key in cls._misplaced:
                    raise ConfigError(f"config key '{path}' is not read here: {cls._misplaced[key]}")
                else:
                    supported = [*names, *cls._aliases, *cls._fixed]
                    err = unknown_key_error(path, key, supported)
                    if "did you mean" not in str(err) and did_you_mean(key, cls._inert):
                        err = ConfigError(f"unknown config key '{path}'{did_you_mean(key, cls._inert)}")
                    if "did you mean" not in str(err):
                        near = did_you_mean(key, cls._not_supported)
                        if near:
                            err = ConfigError(f"unknown config key '{path}'{near} (that key is not supported yet)")
                    raise err
            except ConfigError as err:
                problems.append(err)
        required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        for name in required:
            if name not in kwargs and name not in source:
                problems.append(ConfigError(f"config key '{_join(cls._path, name)}' is required"))
        if problems:
            raise combine_problems(problems)
        return cls(**kwargs)

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's older spellings of this section, rewritten before the keys are read (none by default)."""
        return data

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
