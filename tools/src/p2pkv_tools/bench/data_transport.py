"""What ``p2pkv demo`` and ``p2pkv bench`` need of a data transport besides building it.

- its options: ``--data-options`` (a JSON object, or ``@file`` holding one), checked before
  anything runs by building the transport once over a small region and closing it, so an
  unknown key ends in the transport's own ``ConfigError`` line;
- its memory: every region a p2pkv series or a demo role registers comes from the transport
  class's ``allocate_region`` (a transport that prefers host memory of its own allocation
  runs on exactly that), written once so every page is faulted in before any clock starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from p2pkv.contracts import DataSettings, DataTransport
from p2pkv.data_base import allocated_region
from p2pkv.errors import ConfigError
from p2pkv.json_option import json_object
from p2pkv.registry import Registry, default_registry

__all__ = [
    "DATA_OPTIONS_FLAG",
    "RegionSource",
    "check_bench_data_options",
    "check_data_options",
    "parse_bench_data_options",
    "parse_data_options",
    "transport_region",
]

DATA_OPTIONS_FLAG = "--data-options"
_EXAMPLE = (
    f"""e.g. {DATA_OPTIONS_FLAG} '{{"completion_polls": 1}}' (every transport of """
    f"""--transports), {DATA_OPTIONS_FLAG} 'nixl={{"backends": ["UCX"]}}' (one of """
    f"""them; repeat the flag for each), or @FILE"""
)
_PROBE_BLOCK = 4096
_NAMED = re.compile(r"([A-Za-z0-9_.-]+)=(.*)", re.DOTALL)


def parse_data_options(text: str | None) -> dict[str, Any]:
    """One ``--data-options`` value as a dict (``{}`` when not given). Raises ``ConfigError``
    naming the flag and an example when it is not a JSON object or its file is unreadable."""
    if text is None:
        return {}
    try:
        return json_object(text, DATA_OPTIONS_FLAG, "the data transport's data_options")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; {_EXAMPLE}") from None


def parse_bench_data_options(
    values: Sequence[str] | None, transports: Sequence[str] | None
) -> dict[str, dict[str, Any]]:
    """``p2pkv bench``'s ``--data-options`` values (the flag may repeat) as transport name ->
    its data_options: a plain JSON object (or @FILE) for every transport of ``transports``,
    ``NAME=JSON`` for transport NAME only (a named one wins over a plain one). ``ConfigError``
    without ``--transports``, for a name not in it or given twice, a plain value given twice,
    or a value that is not a JSON object."""
    if not values:
        return {}
    if not transports:
        raise ConfigError(
            f"{DATA_OPTIONS_FLAG} needs --transports NAME[,NAME...]: the "
            f"options go to those data transports"
        )
    shared: dict[str, Any] | None = None
    named: dict[str, dict[str, Any]] = {}
    for value in values:
        match = _NAMED.fullmatch(value.strip())
        if match is None:
            if shared is not None:
                raise ConfigError(
                    f"{DATA_OPTIONS_FLAG} gives options for every transport "
                    f"twice: give them once, and NAME=JSON for each transport "
                    f"whose options differ"
                )
            shared = parse_data_options(value)
            continue
        name = match.group(1)
        if name not in transports:
            raise ConfigError(
                f"{DATA_OPTIONS_FLAG} names {name!r}, which is not in "
                f"--transports {','.join(transports)}: add it there"
            )
        if name in named:
            raise ConfigError(f"{DATA_OPTIONS_FLAG} names {name!r} twice: give its options once")
        named[name] = parse_data_options(match.group(2))
    return {name: named.get(name, shared or {}) for name in transports}


def check_data_options(registry: Registry, name: str, options: Mapping[str, Any]) -> None:
    """Build data transport ``name`` with ``options`` over one small region of its own
    (``allocate_region``) and close it: raises the transport's ``ConfigError`` (an unknown
    key, a bad value) or ``TransportUnavailable`` before anything is measured or started."""
    cls: type[DataTransport] = registry.transport("data", name)
    region = allocated_region(cls, 1, _PROBE_BLOCK, options)
    cls.create(DataSettings(region, _PROBE_BLOCK, options)).close()


def check_bench_data_options(registry: Registry, options: Mapping[str, Mapping[str, Any]]) -> None:
    """``p2pkv bench --data-options``: each transport's options checked on it
    (:func:`check_data_options`) before anything runs."""
    for name, own in options.items():
        check_data_options(registry, name, own)


def transport_region(
    cls: Any, num_blocks: int, block_len: int, options: Mapping[str, Any]
) -> memoryview:
    """``cls.allocate_region(num_blocks, block_len, options)`` (``cls``: a ``DataTransport``
    class), pre-faulted (written once). Raises ``ConfigError`` when it is not a writable
    memoryview of that many bytes."""
    region = allocated_region(cls, num_blocks, block_len, options)
    np.frombuffer(region, dtype=np.uint8).fill(0)  # fault every page in, off the clock
    return region


@dataclass(frozen=True)
class RegionSource:
    """Where a bench group's regions come from (picklable: it crosses to helper processes).

    ``transport``: the p2pkv data transport of the group, whose ``allocate_region`` gives
    them, called with ``options`` (its ``data_options``, which its endpoints get too);
    ``None``: plain process memory (the default ``allocate_region``), for memcpy and for a
    raw baseline measured without its p2pkv transport."""

    transport: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def allocate(self, nbytes: int, block_len: int, registry: Registry | None = None) -> memoryview:
        """A pre-faulted region of ``nbytes // block_len`` blocks of ``block_len``."""
        cls: Any = DataTransport  # its default: zeroed process memory
        if self.transport is not None:
            cls = (registry or default_registry()).transport("data", self.transport)
        return transport_region(cls, nbytes // block_len, block_len, self.options)
