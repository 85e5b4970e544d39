"""Validation of ``control_options`` / ``data_options`` for the memory transports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from p2pkv.errors import ConfigError

__all__ = ["read_options"]


def read_options(
    transport: str, options: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """``defaults`` overlaid with ``options``; every value must have its default's type.

    Raises ``ConfigError`` naming the key for an unknown key or a value of the wrong type.
    Ranges are the caller's to check.
    """
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(
            f"unknown {transport} option(s) {unknown}; valid: {', '.join(sorted(defaults))}"
        )
    values = dict(defaults)
    for key, value in options.items():
        expected = type(defaults[key])
        is_number = isinstance(value, int) and not isinstance(value, bool)
        if expected is float and is_number:
            value = float(value)  # noqa: PLW2901 - an int is a fine float
        ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
        if not ok:
            raise ConfigError(
                f"{transport} option {key!r} must be {expected.__name__}, got {value!r}"
            )
        values[key] = value
    return values
