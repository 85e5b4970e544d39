"""One typed-options parser: a config mapping read into a frozen dataclass, driven by its fields.

Every config surface of p2pkv (the tier config, its ``timeouts`` and ``limits``, each
transport's ``control_options``/``data_options``) is a dataclass whose fields are the keys,
read by :func:`parse_options`, so every surface refuses the same misuse with the same words::

    @dataclass(frozen=True)
    class FooOptions:
        depth: int = field(default=8, metadata=option(ge=1))
        timeout: float = field(default=5.0, metadata=option(gt=0, unit="seconds"))
        mode: Literal["fast", "safe"] = "safe"


    parse_options(FooOptions, {"depth": 4}, "foo data option")

The field's annotation is the type a value must have:

- ``bool``: ``true``/``false`` only (``1`` is not a bool); ``int``: an integer, never a bool;
  ``float``: an integer or a finite float, stored as ``float``; ``str``.
- ``Literal[...]``: one of the choices; ``X | Y``: the first member that takes the value
  (``X | None``: ``null`` is accepted and kept).
- ``tuple[X, ...]``: a list (or tuple) of ``X``, stored as a tuple.
- ``Mapping[str, X]``/``dict[str, X]``: a mapping with string keys and ``X`` values, stored as
  a dict; ``Any`` takes anything.
- a dataclass: a nested mapping, read the same way (its keys named ``parent.child``).

Field metadata (:func:`option`) adds the config key when it differs from the field name, the
bounds of a number (``ge``, ``gt``, ``le``), ``nonblank`` and the unit named in messages;
a number without an upper bound of its own still has one: :data:`MAX_SECONDS` for a field in
``seconds``, :data:`MAX_INTEGER` for an integer (so no value overflows a C integer or a
millisecond count, and none ends in a traceback);
:func:`derived` marks a field that is not a key at all (set by the code). Every refusal is one
:class:`~p2pkv.errors.ConfigError` naming ``where``, the key and what would be valid: an
unknown key (with the closest valid one), a value of the wrong type, or out of bounds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from p2pkv.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_META = "p2pkv.option"
_MAX_SHOWN = 80
MAX_SECONDS = 1_000_000.0
"""The largest value of a field in seconds without an ``le`` of its own (11.5 days): libzmq
and the tier turn seconds into milliseconds in 32-bit integers, and no wait of p2pkv's is
meant to be longer."""
MAX_INTEGER = 2**63 - 1
"""The largest integer any field takes without an ``le`` of its own (what msgpack and C
carry)."""


@dataclass(frozen=True)
class Option:
    """How one dataclass field is read (kept in the field's metadata by :func:`option`)."""

    key: str | None = None
    """The config key; None: the field name."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    nonblank: bool = False
    """A string must hold more than whitespace (stored stripped); a list must not be empty
    and each of its strings must hold more than whitespace."""
    unit: str = ""
    """Named after a bound in messages (``"seconds"``)."""
    is_key: bool = True
    """False: the field is set by the code, never read from the mapping."""


def option(
    *,
    key: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    nonblank: bool = False,
    unit: str = "",
) -> dict[str, Option]:
    """Field metadata for a key: ``field(default=..., metadata=option(ge=0))``."""
    return {_META: Option(key, ge, gt, le, nonblank, unit)}


def derived() -> dict[str, Option]:
    """Field metadata for a field that is not a config key (the code sets it)."""
    return {_META: Option(is_key=False)}


def _rule(f: dataclasses.Field[Any]) -> Option:
    rule = f.metadata.get(_META, Option())
    assert isinstance(rule, Option)
    return rule


def option_key(f: dataclasses.Field[Any]) -> str | None:
    """The config key of field ``f``; None when it is not a key (:func:`derived`)."""
    rule = _rule(f)
    if not rule.is_key:
        return None
    return rule.key or f.name


def option_keys(cls: type[DataclassInstance]) -> tuple[str, ...]:
    """The keys :func:`parse_options` accepts for ``cls``, in field order."""
    return tuple(k for f in dataclasses.fields(cls) if (k := option_key(f)) is not None)


def parse_options(
    cls: type[T],
    raw: Mapping[str, Any],
    where: str,
    *,
    also_accepted: tuple[str, ...] = (),
    shown_as: Mapping[str, str] | None = None,
) -> T:
    """Read ``raw`` into a ``cls`` (a dataclass): each key present is checked against its
    field's type and metadata, absent keys keep their defaults.

    ``where`` names a key in messages: ``"zmq control option"`` gives "unknown zmq control
    option(s) ['x']; valid keys: ..." and "zmq control option 'insecure' must be true or
    false, got 'yes'". Raises ``ConfigError``; a field type this parser cannot read is a
    programming error (``TypeError``).

    ``also_accepted``: keys the caller reads itself before (an engine's own keys, aliases),
    listed among the valid keys of an unknown-key message. ``shown_as``: a key path
    (``timeouts.unbound_store``) -> the name the operator wrote (an alias such as
    ``unbound_store_timeout_s``), used in messages about that key instead of the path.
    """
    context = _Context(where, also_accepted, dict(shown_as or {}))
    return _parse(cls, raw, context, "")


@dataclass(frozen=True)
class _Context:
    where: str
    also_accepted: tuple[str, ...]
    shown_as: dict[str, str]

    def name(self, path: str) -> str:
        """How a message names the key at ``path``."""
        alias = self.shown_as.get(path)
        return f"{self.where} {path!r}" if alias is None else f"key {alias!r}"


def _parse(cls: type[T], raw: object, where: _Context, prefix: str) -> T:
    if not isinstance(raw, Mapping):
        name = prefix.rstrip(".")
        what = where.name(name) if name else where.where
        raise ConfigError(f"{what} must be a mapping, got {shown(raw)}")
    fields = {key: f for f in dataclasses.fields(cls) if (key := option_key(f)) is not None}
    _refuse_unknown(raw, list(fields), where, prefix)
    hints = typing.get_type_hints(cls)
    values = {
        f.name: _field_value(hints[f.name], _rule(f), raw[key], where, prefix + key)
        for key, f in fields.items()
        if key in raw
    }
    return cls(**values)


def _refuse_unknown(raw: Mapping[Any, Any], keys: list[str], where: _Context, prefix: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in keys)
    if not unknown:
        return
    named = [prefix + k for k in unknown]
    scope = f" of {prefix.rstrip('.')!r}" if prefix else ""
    valid = keys + ([k for k in where.also_accepted if k not in keys] if not prefix else [])
    guess = difflib.get_close_matches(unknown[0], valid, n=1)
    hint = f"; did you mean {prefix + guess[0]!r}?" if guess else ""
    raise ConfigError(
        f"unknown {where.where}(s) {named}; valid keys{scope}: {', '.join(valid)}{hint}"
    )


class _Mismatch(Exception):
    """A value is not of the expected type (:func:`_describe` says what was expected)."""


def _field_value(tp: Any, rule: Option, value: Any, where: _Context, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _parse(tp, value, where, name + ".")  # type: ignore[arg-type]
    try:
        result = _coerce(tp, value, rule.nonblank)
    except _Mismatch:
        blank = rule.nonblank and _accepts(tp, value)  # the type is right, but it is blank
        expected = _describe(tp, nonblank=blank)
        raise ConfigError(f"{where.name(name)} must be {expected}, got {shown(value)}") from None
    bound = _violated_bound(rule, result)
    if bound:
        unit = f" {rule.unit}" if rule.unit else ""
        raise ConfigError(f"{where.name(name)} must be {bound}{unit}, got {shown(value)}")
    return result


def _accepts(tp: Any, value: Any) -> bool:
    try:
        _coerce(tp, value)
    except _Mismatch:
        return False
    return True


def shown(value: object) -> str:
    """``repr(value)``, cut short: a message stays one readable line (an integer too long to
    print is named by its number of digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return (
            f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
            if isinstance(value, int)
            else "a value too large to show"
        )
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _violated_bound(rule: Option, value: Any) -> str:
    """The bound ``value`` breaks ("> 0", "in 1..10"), or "" (also for a non-number)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    le = rule.le
    if le is None:
        le = (
            MAX_SECONDS
            if rule.unit == "seconds"
            else MAX_INTEGER
            if isinstance(value, int)
            else None
        )
    low_ok = rule.ge is None or value >= rule.ge
    high_ok = le is None or value <= le
    if rule.ge is not None and le is not None and not (low_ok and high_ok):
        return f"in {_number(rule.ge)}..{_number(le)}"
    if rule.ge is not None and not low_ok:
        return f">= {_number(rule.ge)}"
    if rule.gt is not None and not value > rule.gt:
        return f"> {_number(rule.gt)}"
    if le is not None and not high_ok:
        return f"<= {_number(le)}"
    return ""


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _coerce(tp: Any, value: Any, nonblank: bool = False) -> Any:
    """``value`` as type ``tp`` (ints widened to float, lists to tuples, strings stripped
    when ``nonblank``); ``_Mismatch`` when it is not one."""
    if tp is Any:
        return value
    if tp in _WORDS:
        return _scalar(tp, value, nonblank)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if any(value == c and type(value) is type(c) for c in args):
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return _coerce(member, value, nonblank)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise _Mismatch
        if nonblank and not value:
            raise _Mismatch
        return tuple(_coerce(args[0], v, nonblank) for v in value)
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _Mismatch
        return {k: _coerce(args[1], v) for k, v in value.items()}
    raise TypeError(f"parse_options cannot read fields of type {tp!r}")


def _scalar(tp: type, value: Any, nonblank: bool) -> Any:
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _Mismatch
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise _Mismatch
    if nonblank and isinstance(value, str):
        if not value.strip():
            raise _Mismatch
        return value.strip()
    return value


_WORDS: dict[Any, tuple[str, str]] = {
    bool: ("true or false", "true or false"),
    int: ("an integer", "integers"),
    float: ("a finite number", "finite numbers"),
    str: ("a string", "strings"),
    type(None): ("null", "null"),
}
_NONBLANK = ("a non-empty string", "non-empty strings")


def _describe(tp: Any, *, plural: bool = False, nonblank: bool = False) -> str:
    """What type ``tp`` accepts, in words: "an integer", plural "integers"."""
    words = _NONBLANK if tp is str and nonblank else _WORDS.get(tp)
    if words is not None:
        return words[plural]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(m, plural=plural, nonblank=nonblank) for m in args)
    if origin is tuple:
        items = _describe(args[0], plural=True, nonblank=nonblank)
        kind = ("non-empty " if nonblank else "") + ("lists" if plural else "list")
        return f"{kind} of {items}" if plural else f"a {kind} of {items}"
    if origin in (Mapping, dict) and args[1] is not Any:
        kind = "mappings" if plural else "a mapping"
        return f"{kind} of names to {_describe(args[1], plural=True)}"
    return "mappings" if plural else "a mapping"
