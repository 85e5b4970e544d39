"""``parse_options``: types from annotations, bounds from metadata, one message per misuse."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from p2pkv.errors import ConfigError
from p2pkv.options import derived, option, option_keys, parse_options


@dataclass(frozen=True)
class Inner:
    depth: int = field(default=1, metadata=option(gt=0))


@dataclass(frozen=True)
class Shape:
    flag: bool = False
    count: int = field(default=2, metadata=option(ge=1, le=10))
    seconds: float = field(default=1.0, metadata=option(ge=0, unit="seconds"))
    name: str | None = field(default=None, metadata=option(nonblank=True))
    mode: Literal["a", "b"] = "a"
    names: tuple[str, ...] = field(default=(), metadata=option(nonblank=True))
    params: Mapping[str, str] = field(default_factory=dict)
    anything: Mapping[str, Any] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    renamed: int = field(default=0, metadata=option(key="alias"))
    computed: int = field(default=0, metadata=derived())


def parse(**raw: Any) -> Shape:
    return parse_options(Shape, raw, "shape key")


def test_defaults_and_values() -> None:
    assert parse() == Shape()
    got = parse(
        flag=True,
        count=3,
        seconds=2,
        name=" x ",
        mode="b",
        names=["p", " q"],
        params={"k": "v"},
        anything={"k": [1]},
        inner={"depth": 4},
        alias=7,
    )
    assert got == Shape(True, 3, 2.0, "x", "b", ("p", "q"), {"k": "v"}, {"k": [1]}, Inner(4), 7)
    assert isinstance(got.seconds, float) and isinstance(got.names, tuple)
    assert parse(name=None).name is None


def test_keys_follow_the_metadata() -> None:
    assert option_keys(Shape) == (
        "flag",
        "count",
        "seconds",
        "name",
        "mode",
        "names",
        "params",
        "anything",
        "inner",
        "alias",
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"flga": 1},
            "unknown shape key(s) ['flga']; valid keys: flag, count, seconds, name, "
            "mode, names, params, anything, inner, alias; did you mean 'flag'?",
        ),
        ({"computed": 1}, "unknown shape key(s) ['computed']"),
        ({"renamed": 1}, "unknown shape key(s) ['renamed']"),
        (
            {"inner": {"dpth": 1}},
            "unknown shape key(s) ['inner.dpth']; valid keys of 'inner': "
            "depth; did you mean 'inner.depth'?",
        ),
        ({"flag": 1}, "shape key 'flag' must be true or false, got 1"),
        ({"count": True}, "shape key 'count' must be an integer, got True"),
        ({"count": 2.0}, "shape key 'count' must be an integer, got 2.0"),
        ({"count": 0}, "shape key 'count' must be in 1..10, got 0"),
        ({"seconds": -1}, "shape key 'seconds' must be in 0..1000000 seconds, got -1"),
        ({"seconds": 1e300}, "shape key 'seconds' must be in 0..1000000 seconds, got 1e+300"),
        (
            {"count": 10**5000},
            "shape key 'count' must be in 1..10, got an integer of about 5001 digits",
        ),
        ({"seconds": float("inf")}, "shape key 'seconds' must be a finite number, got inf"),
        ({"seconds": False}, "shape key 'seconds' must be a finite number, got False"),
        ({"name": " "}, "shape key 'name' must be a non-empty string or null, got ' '"),
        ({"name": 5}, "shape key 'name' must be a string or null, got 5"),
        ({"mode": "c"}, "shape key 'mode' must be one of 'a', 'b', got 'c'"),
        ({"names": "p"}, "shape key 'names' must be a list of strings, got 'p'"),
        ({"names": ["p", ""]}, "shape key 'names' must be a non-empty list of non-empty strings"),
        ({"names": []}, "shape key 'names' must be a non-empty list of non-empty strings"),
        ({"params": {"k": 1}}, "shape key 'params' must be a mapping of names to strings"),
        ({"anything": [1]}, "shape key 'anything' must be a mapping, got [1]"),
        ({"inner": 3}, "shape key 'inner' must be a mapping, got 3"),
        ({"inner": {"depth": 0}}, "shape key 'inner.depth' must be > 0, got 0"),
        ({"alias": "x" * 200}, "got 'xxxxx"),
    ],
)
def test_each_misuse_is_one_message_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_options(Shape, raw, "shape key")
    assert message in str(info.value)
    assert len(str(info.value)) < 300


def test_an_unreadable_field_type_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Odd:
        value: set[int] = field(default_factory=set)

    with pytest.raises(TypeError, match="cannot read"):
        parse_options(Odd, {"value": [1]}, "odd key")
