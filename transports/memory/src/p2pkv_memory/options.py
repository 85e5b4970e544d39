"""Validation of ``control_options`` / ``data_options`` for the memory transports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, field, make_dataclass
from typing import Any

from p2pkv.options import parse_options

__all__ = ["read_options"]


def read_options(
    transport: str, options: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """``defaults`` overlaid with ``options``; every value must have its default's type (an
    integer is a fine float, a bool is not an integer), read by :func:`p2pkv.options.parse_options`.

    Raises ``ConfigError`` naming the key for an unknown key or a value of the wrong type.
    Ranges are the caller's to check.
    """
    shape = make_dataclass(
        f"{transport} options",
        [(key, type(value), field(default=value)) for key, value in defaults.items()],
        frozen=True,
    )
    parsed: Any = parse_options(shape, options, f"{transport} option")
    return asdict(parsed)
