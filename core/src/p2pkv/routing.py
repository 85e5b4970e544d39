"""Request routing from ``kv_transfer_params`` (the dicts a PD router puts on each request).

Keys (legacy names in brackets, accepted the same way):

``remote_prefiller`` [``prefill``]
    On a decode request: this instance is a **PD consumer** of the producer at
    ``remote_host``/``remote_port``. ``lookup`` answers HIT at once (eager).
``remote_kv_source`` [``p2p``]
    This instance is a **symmetric consumer**: it probes the source with batched lookups and
    loads only what the source reports as present.
``remote_decoder`` [``decode``]
    On a prefill request: this instance **produces** blocks for whichever consumer fetches
    ``kv_request_id``. Only ``kv_request_id`` is needed.

Consumer dicts need ``kv_request_id`` (non-empty string), ``remote_host`` (non-empty string)
and ``remote_port`` (integer 1..65535, or its decimal string). Other keys inside a dict and
other top-level keys are ignored; one that looks like a misspelt routing key
(``remote_prefill`` for ``remote_prefiller``) is logged once per key, naming the key it
resembles. The only legal multi-key combination is ``remote_decoder`` + ``remote_kv_source``;
any other combination (including a key together with its own legacy name) is refused. A
refused or malformed routing gives no route and a logged reason; it never raises.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv.addressing import format_address

log = logging.getLogger(__name__)

_PD_CONSUMER = ("remote_prefiller", "prefill")
_SYM_CONSUMER = ("remote_kv_source", "p2p")
_PRODUCER = ("remote_decoder", "decode")
_ROUTING_KEYS = (*_PD_CONSUMER, *_SYM_CONSUMER, *_PRODUCER)
_ROUTING_KEY_SET = frozenset(_ROUTING_KEYS)
_OTHER_CONNECTORS_KEYS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_dp_size",
    "remote_tp_size",
    "tp_size",
)
"""Keys other KV connectors of vLLM put in ``kv_transfer_params`` (NixlConnector and the
like): never a misspelling of ours, however close."""
_SEEN_KEYS: dict[str, str] = dict.fromkeys(_OTHER_CONNECTORS_KEYS, "")
"""Top-level keys already judged: the routing key each resembles ("" for none). Bounded."""
_SEEN_CAP = 1024


@dataclass(frozen=True, slots=True)
class ConsumerRoute:
    """Load this request's blocks from ``peer`` under ``kv_request_id``."""

    kv_request_id: str
    peer: str
    probe: bool
    """True for symmetric consumers (lookup before load), False for PD (eager HIT)."""


@dataclass(frozen=True, slots=True)
class ProducerRoute:
    """Offer this request's blocks to whoever fetches ``kv_request_id``."""

    kv_request_id: str


@dataclass(frozen=True, slots=True)
class Routing:
    consumer: ConsumerRoute | None = None
    producer: ProducerRoute | None = None
    error: str = ""
    """Why the params were refused (then both routes are None); empty when valid."""

    @property
    def invalid(self) -> bool:
        return bool(self.error)


NO_ROUTING = Routing()


class _Refused(Exception):
    pass


def parse_routing(
    params: Mapping[str, Any] | None, *, max_request_id_chars: int = 256, req_id: str = ""
) -> Routing:
    """Parse ``params``; never raises. A refusal is logged once (with ``req_id``) and returned
    as a ``Routing`` with ``error`` set and no routes."""
    if not params:
        return NO_ROUTING
    try:
        if type(params) is not dict and not isinstance(params, Mapping):
            raise _Refused(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
        if not _ROUTING_KEY_SET.issuperset(params):
            _warn_misspelt(params, req_id)
        pd = _pick(params, _PD_CONSUMER)
        sym = _pick(params, _SYM_CONSUMER)
        prod = _pick(params, _PRODUCER)
        if pd is not None and (sym is not None or prod is not None):
            others = [k for k in (*_SYM_CONSUMER, *_PRODUCER) if k in params]
            raise _Refused(f"{pd[0]!r} cannot be combined with {others}")
        consumer = None
        if pd is not None:
            consumer = _consumer(pd[0], pd[1], max_request_id_chars, probe=False)
        elif sym is not None:
            consumer = _consumer(sym[0], sym[1], max_request_id_chars, probe=True)
        producer = None
        if prod is not None:
            producer = ProducerRoute(_request_id(prod[0], prod[1], max_request_id_chars))
    except _Refused as exc:
        log.warning("request %s: no P2P route: %s", req_id or "?", exc)
        return Routing(error=str(exc))
    if consumer is None and producer is None:
        return NO_ROUTING
    return Routing(consumer, producer)


def _warn_misspelt(params: Mapping[str, Any], req_id: str) -> None:
    """Log, once per key, a top-level key that resembles a routing key but is none."""
    for key in params:
        if key in _ROUTING_KEY_SET or key in _SEEN_KEYS or not isinstance(key, str):
            continue
        if len(_SEEN_KEYS) >= _SEEN_CAP:
            return
        close = difflib.get_close_matches(key, _ROUTING_KEYS, n=1, cutoff=0.8)
        _SEEN_KEYS[key] = close[0] if close else ""
        if close:
            log.warning(
                "request %s: kv_transfer_params key %r is not a p2pkv routing key "
                "(ignored); did you mean %r? (logged once per key)",
                req_id or "?",
                key,
                close[0],
            )


def _pick(params: Mapping[str, Any], names: tuple[str, str]) -> tuple[str, Any] | None:
    name, legacy = names
    if name not in params:
        return (legacy, params[legacy]) if legacy in params else None
    if legacy in params:
        raise _Refused(f"both {name!r} and its legacy name {legacy!r} are given")
    return name, params[name]


def _request_id(name: str, d: Any, max_chars: int) -> str:
    if type(d) is not dict and not isinstance(d, Mapping):
        raise _Refused(f"{name!r} must be a mapping, got {type(d).__name__}")
    kv = d.get("kv_request_id")
    if not isinstance(kv, str) or not kv:
        raise _Refused(f"{name}.kv_request_id must be a non-empty string, got {kv!r}")
    if len(kv) > max_chars:
        raise _Refused(f"{name}.kv_request_id is longer than {max_chars} characters")
    return kv


def _consumer(name: str, d: Any, max_chars: int, *, probe: bool) -> ConsumerRoute:
    kv = _request_id(name, d, max_chars)
    host = d.get("remote_host")
    if not isinstance(host, str) or not host.strip("[]"):
        raise _Refused(f"{name}.remote_host must be a non-empty string, got {host!r}")
    port = d.get("remote_port")
    if isinstance(port, str) and port.isdecimal():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _Refused(f"{name}.remote_port must be an integer in 1..65535, got {port!r}")
    return ConsumerRoute(kv, format_address(host, port), probe)
