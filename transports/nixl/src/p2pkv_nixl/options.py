"""``data_options`` of the ``nixl`` transport: parsed once, every rejection names the key.

========================  =========  =====================================================
key                       default    meaning
========================  =========  =====================================================
``backends``              ``[UCX]``  NIXL backends to create, in order
``num_threads``           ``0``      each backend's ``num_threads`` (0: its default)
``enable_prog_thread``    ``false``  NIXL's own progress thread (spins a core)
``drain_timeout``         ``5.0``    seconds ``remove_peer``/``close``/``cancel`` may wait
``backend_params``        ``{}``     extra init parameters per backend
``warmup``                ``true``   ``add_peer`` wires the connection up with a tiny READ
``staging``               ``auto``   ``auto``/``always``/``never``: reads through the
                                     staging pool (see :mod:`p2pkv_nixl.staging`)
``staging_blocks``        ``256``    blocks in the staging pool (capped at the region's)
========================  =========  =====================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from p2pkv.errors import ConfigError

from p2pkv_nixl.descriptor import MAX_BLOCKS

__all__ = ["STAGING_MODES", "NixlOptions", "Staging"]

Staging = Literal["auto", "always", "never"]
STAGING_MODES: tuple[Staging, ...] = ("auto", "always", "never")


@dataclass(frozen=True)
class NixlOptions:
    """Validated options (see the README's options table for the why of each default)."""

    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends (plugins) to instantiate, in order."""
    num_threads: int = 0
    """Passed to each backend as its ``num_threads`` init parameter; 0 = backend default."""
    enable_prog_thread: bool = False
    """NIXL's own progress thread. Off: it spins a core and halves throughput on small hosts;
    ``progress()``/``poll()`` drive the worker instead, so the caller must tick them."""
    drain_timeout: float = 5.0
    """Seconds ``remove_peer``/``close`` wait for internal transfers (warm-ups; ``close``
    also for quarantined staged reads), and ``cancel`` for a direct read NIXL would not
    release."""
    backend_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Extra init parameters per backend, e.g. ``{"UCX": {"ucx_error_handling_mode": "none"}}``."""
    warmup: bool = True
    """``add_peer`` posts a tiny READ from the peer so the connection is wired up before the
    first real read (otherwise that read pays the endpoint wire-up)."""
    staging: Staging = "auto"
    """Where reads land first. ``auto``: straight into the slots when the peer is on this
    host and both sides have UCX's ``cma`` (our own process copies, so a cancel is final),
    else through the staging pool. ``always``: every read is staged. ``never``: every read
    is direct; on a lane other than ``cma`` a cancelled read may then still land in the
    slots (finality is the operator's responsibility; a warning is logged at create)."""
    staging_blocks: int = 256
    """Blocks in the staging pool (allocated on first use; capped at the region's
    ``num_blocks``). A read needs as many free blocks as it moves; blocks of a cancelled
    staged read stay quarantined until NIXL reports it ended."""

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> NixlOptions:
        """Validate ``data_options``; ``ConfigError`` names the offending key."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown nixl data option(s) {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        if "backends" in options:
            values["backends"] = _backends(options["backends"])
        if "num_threads" in options:
            values["num_threads"] = _count(options["num_threads"], "num_threads")
        for key in ("enable_prog_thread", "warmup"):
            if key in options:
                if not isinstance(options[key], bool):
                    raise ConfigError(
                        f"nixl data option {key!r} must be a bool, got {options[key]!r}"
                    )
                values[key] = options[key]
        if "staging" in options:
            values["staging"] = _staging(options["staging"])
        if "staging_blocks" in options:
            values["staging_blocks"] = _count(options["staging_blocks"], "staging_blocks", 1)
        if "drain_timeout" in options:
            values["drain_timeout"] = _seconds(options["drain_timeout"], "drain_timeout")
        if "backend_params" in options:
            backends = values.get("backends", cls.backends)
            values["backend_params"] = _backend_params(options["backend_params"], backends)
        return cls(**values)

    def init_params(self, backend: str) -> dict[str, str]:
        """The init parameters ``backend`` is created with."""
        params = {"num_threads": str(self.num_threads)} if self.num_threads else {}
        params.update(self.backend_params.get(backend, {}))
        return params


def _backends(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"nixl data option 'backends' must be a list of names, got {value!r}")
    names = tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"nixl data option 'backends' must be a non-empty list of names, got {value!r}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"nixl data option 'backends' names a backend twice: {value!r}")
    return names


def _count(value: Any, key: str, least: int = 0) -> int:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not least <= value <= MAX_BLOCKS):
        raise ConfigError(
            f"nixl data option {key!r} must be an integer in {least}..{MAX_BLOCKS}, "
            f"got {value!r}"
        )
    return value


def _staging(value: Any) -> Staging:
    if value not in STAGING_MODES:
        raise ConfigError(
            f"nixl data option 'staging' must be one of {', '.join(STAGING_MODES)}, "
            f"got {value!r}"
        )
    return cast(Staging, value)


def _seconds(value: Any, key: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"nixl data option {key!r} must be a number of seconds >= 0, got {value!r}"
        )
    return float(value)


def _backend_params(value: Any, backends: tuple[str, ...]) -> dict[str, dict[str, str]]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"nixl data option 'backend_params' must map a backend name to its parameters, "
            f"got {value!r}"
        )
    params: dict[str, dict[str, str]] = {}
    for backend, entries in value.items():
        if backend not in backends:
            raise ConfigError(
                f"nixl data option 'backend_params' names backend {backend!r}, which is not in "
                f"'backends' {list(backends)}"
            )
        if not isinstance(entries, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, int, float, bool))
            for k, v in entries.items()
        ):
            raise ConfigError(
                f"nixl data option 'backend_params'[{backend!r}] must map parameter names to "
                f"strings or numbers, got {entries!r}"
            )
        params[backend] = {k: _param_text(v) for k, v in entries.items()}
    return params


def _param_text(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
