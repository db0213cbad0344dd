"""Property-based tests over configs (hypothesis): whatever a user writes, rayzero either accepts it or
raises a ConfigError that names the key, never an exception from deep inside."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from rayzero.config import Config, ConfigError, _Section
from rayzero.optim.factory import build_optimizer

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _unwrap(hint) -> tuple[typing.Any, bool]:
    """(the type, whether None is allowed) of a field's type hint."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(hint)
        inner = [a for a in args if a is not type(None)]
        return inner[0], type(None) in args
    return hint, False


def _leaves(cls, prefix: tuple = ()) -> list[tuple[tuple, typing.Any, bool]]:
    """Every key of the config tree as (path, type, optional); sections too (their type is the section)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap(hints[f.name])
        path = prefix + (f.name,)
        out.append((path, tp, optional))
        if isinstance(tp, type) and issubclass(tp, _Section):
            out += _leaves(tp, path)
    return out


LEAVES = _leaves(Config)
SECTIONS = [()] + [path for path, tp, _ in LEAVES if isinstance(tp, type) and issubclass(tp, _Section)]


def _section_class(path: tuple):
    cls = Config
    for key in path:
        cls = _unwrap(typing.get_type_hints(cls)[key])[0]
    return cls


# a valid config with every section that has a required key: the keys under test are set into a copy
BASE = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def _nested(path: tuple, value) -> dict:
    """A copy of BASE with the key at ``path`` (("a", "b") is cfg["a"]["b"]) set to ``value``."""
    cfg = copy.deepcopy(BASE)
    where = cfg
    for key in path[:-1]:
        where = where.setdefault(key, {})
    where[path[-1]] = value
    return cfg


def _wrong_type_values(tp, optional: bool) -> st.SearchStrategy:
    """Values that are not of type ``tp`` in any accepted spelling (ints written as whole floats are ints)."""
    lists, maps = st.lists(st.integers(), max_size=2), st.dictionaries(st.sampled_from("xyz"), st.integers(), max_size=2)
    texts = st.text(max_size=6)
    none = st.nothing() if optional else st.none()
    if tp is int:
        return st.one_of(texts, lists, maps, st.booleans(), none,
                         st.floats(allow_nan=True).filter(lambda v: not (math.isfinite(v) and v.is_integer())))
    if tp is float:
        return st.one_of(texts, lists, maps, st.booleans(), none)
    if tp is bool:
        return st.one_of(texts, lists, maps, st.integers(), st.floats(), none)
    if tp is str:
        return st.one_of(lists, maps, st.integers(), st.floats(), st.booleans(), none)
    if tp is dict or typing.get_origin(tp) is dict:
        return st.one_of(texts, lists, st.integers(), st.booleans(), none)
    if tp is list or typing.get_origin(tp) is list:
        return st.one_of(texts, maps, st.integers(), st.floats(), st.booleans(), none)
    if isinstance(tp, type) and issubclass(tp, _Section):
        return st.one_of(texts, lists, st.integers(), st.floats(), st.booleans(), none)
    raise AssertionError(f"no wrong values for {tp!r}")


@st.composite
def wrong_type(draw):
    path, tp, optional = draw(st.sampled_from(LEAVES))
    return path, draw(_wrong_type_values(tp, optional))


@SETTINGS
@given(wrong_type())
def test_a_value_of_the_wrong_type_names_its_key(case):
    path, value = case
    assume(not (path == ("zero_optimization",) and isinstance(value, bool)))  # DeepSpeed's older form, read
    assume(value != "auto")  # in the sections DeepSpeed reads "auto" as the default, rayzero does too
    # the Hugging Face Trainer's fractional prefetch size (0.9 * hidden_size**2), rounded down
    assume(not (path == ("zero_optimization", "stage3_prefetch_bucket_size") and isinstance(value, float)))
    with pytest.raises(ConfigError) as e:
        Config.from_any(_nested(path, value))
    assert ".".join(path) in str(e.value), str(e.value)


KEY_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=14)


@SETTINGS
@given(st.sampled_from(SECTIONS), KEY_NAMES, st.integers())
def test_an_unknown_key_is_named_with_its_section(section, key, value):
    cls = _section_class(section)
    known = set(cls._field_names()) | set(cls._aliases) | set(cls._fixed) | set(cls._not_supported) | set(cls._inert)
    assume(key not in known)
    with pytest.raises(ConfigError) as e:
        Config.from_any(_nested(section + (key,), value))
    assert ".".join(section + (key,)) in str(e.value), str(e.value)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**40), max_value=2**40) | st.floats() | st.text(max_size=8)
    | st.sampled_from(["auto", "none", "cpu", "nvme", "AdamW", "SGD", "WarmupLR", "bf16", 0, 1, 2, 3, 1e9, 5e8]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# keys a user is likely to write: every key of the tree, optimizer and scheduler params, and a few typos
PARAM_KEYS = ["lr", "betas", "eps", "weight_decay", "momentum", "amsgrad", "fused", "foreach", "warmup_num_steps",
              "warmup_min_lr", "warmup_max_lr", "total_num_steps", "warmup_type", "cos_min_ratio", "nesterov"]


@st.composite
def config_dicts(draw):
    """A config built from several keys of the tree set to arbitrary JSON values (often right, often not)."""
    cfg: dict = copy.deepcopy(BASE) if draw(st.booleans()) else {}
    for _ in range(draw(st.integers(1, 5))):
        path, tp, _ = draw(st.sampled_from(LEAVES))
        if path[-1] == "params" and draw(st.booleans()):
            value = draw(st.dictionaries(st.sampled_from(PARAM_KEYS), JSON, max_size=3))
        elif tp is int:
            value = draw(st.one_of(st.integers(-4, 64), JSON))
        else:
            value = draw(JSON)
        where = cfg
        for key in path[:-1]:
            nxt = where.get(key)
            if not isinstance(nxt, dict):
                nxt = where[key] = {}
            where = nxt
        where[path[-1]] = value
    return cfg


@SETTINGS
@given(config_dicts(), st.integers(1, 9))
def test_any_config_is_accepted_or_refused_with_a_config_error(cfg, world):
    """Parsing, batch planning and building the optimizer raise nothing but ConfigError."""
    try:
        config = Config.from_any(cfg)
    except ConfigError as e:
        assert "'" in str(e), f"the message names no key: {e}"
        event("refused")
        return
    event("accepted")
    try:
        config.resolve_batch(world)
    except ConfigError:
        event("batch refused")
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer(config.optimizer, [{"params": [p]}])
    assert opt.param_groups[0]["params"][0] is p
    assert Config.from_any(config.to_dict()) == config  # what it accepted, it reads back the same
