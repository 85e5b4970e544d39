"""vLLM-free half of the adapter: config, request contexts, jobs, and the hit source.

Everything here works on duck-typed vLLM objects, so it is unit-tested without vLLM; the
vLLM-bound half (``p2pkv_vllm.adapter``) only injects vLLM's classes and enums.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from p2pkv.addressing import format_address
from p2pkv.config import VLLM_HOST_ENV, VLLM_PORT_ENV, TierConfig, config_fingerprint
from p2pkv.errors import ConfigError
from p2pkv.routing import Routing
from p2pkv.types import Job, JobResult, LookupResult, RequestContext

__all__ = [
    "ENTRY_CONTEXT",
    "ENTRY_KEYS",
    "HOST_ENV",
    "IDLE_WAIT_KEY",
    "LOCALITIES",
    "PORT_ENV",
    "PRECONNECT_KEY",
    "REPLACE_ENV",
    "TIER_TYPE",
    "UPSTREAM_KEYS",
    "UPSTREAM_TYPE",
    "FailedLoadLog",
    "ParentHitSource",
    "check_engine_keys",
    "context_of",
    "entry_tier_config",
    "idle_wait_of",
    "job_of",
    "preconnect_peers",
    "replace_requested",
    "resolve_hash_seed",
    "slots_of",
    "tier_config_from_keys",
    "upstream_keys_mapped",
    "zero_edit_keys",
]

HOST_ENV = VLLM_HOST_ENV
"""Environment variables for the bind/advertised host, first set one wins (vLLM's name first)."""
PORT_ENV = VLLM_PORT_ENV
"""Environment variables for the base port; the bound port is base + DP rank."""

TIER_TYPE = "P2PKVTier"
"""The ``type`` of the tier's ``secondary_tiers`` entry: the class vLLM loads from
``module_path``."""
LOCALITIES = ("LOCAL", "REMOTE")
"""Values of vLLM's ``Locality`` (0.32, 0.33); the vLLM tests check they still match."""
ENTRY_KEYS = ("type", "module_path", "backpressure", "locality")
"""Keys of a ``secondary_tiers`` entry that vLLM reads (the rest are tier keys)."""

PRECONNECT_KEY = "p2pkv_connect"
"""``kv_transfer_params`` key of a pre-connect hint: a list of ``{"remote_host": ...,
"remote_port": ...}`` peers this instance will pull from; the tier opens its sessions to
them now (``P2PTier.connect``) so that the first request pulling from one does not wait for
the dial and the handshake. The request itself runs as any other."""
MAX_PRECONNECT = 256
"""Peers one hint may name (the rest are ignored, and logged)."""

_log = logging.getLogger(__name__)

ENTRY_CONTEXT = "P2PKVTier secondary_tiers entry: "
"""How this adapter's ``ConfigError`` messages begin, naming the entry in an engine's log;
``p2pkv check-config`` and ``doctor`` name it by its index instead and leave this out."""

_DERIVED_KEYS = ("fingerprint", "hash_seed")
"""TierConfig keys the adapter derives from the engine; an explicit tier key still wins."""

UPSTREAM_KEYS: Mapping[str, tuple[str, str]] = {
    "backends": ("data_options", "backends"),
    "num_threads": ("data_options", "num_threads"),
    "unbound_store_timeout_s": ("timeouts", "unbound_store"),
}
"""Keys of vLLM's built-in P2P tier (``p2p/manager.py``, 0.27.1-0.33; ``host`` and ``port``
are p2pkv's keys too) -> where p2pkv keeps the same setting: NIXL's backends and agent
threads (nixl data options; upstream's tier is NIXL), the seconds a producer holds stores
nobody fetched. Accepted in every entry, with upstream's meaning."""


def tier_config_from_keys(
    tier_keys: Mapping[str, Any],
    *,
    dp_rank: int,
    run_config: Mapping[str, Any],
    hash_seed: str,
    environ: Mapping[str, str] | None = None,
) -> TierConfig:
    """The ``TierConfig`` for the keys of one ``secondary_tiers`` entry.

    ``tier_keys`` is what vLLM's factory passes on (``type``, ``module_path``,
    ``backpressure`` and ``locality`` already removed). The fingerprint is derived from
    ``run_config`` and ``hash_seed`` from the engine unless the keys set them. Raises
    ``ConfigError`` naming any unknown or invalid key.
    """
    keys = upstream_keys_mapped(tier_keys)
    derived = {"fingerprint": config_fingerprint(run_config), "hash_seed": hash_seed}
    for name in _DERIVED_KEYS:
        keys.setdefault(name, derived[name])
    aliases = {
        f"{section}.{name}": alias
        for alias, (section, name) in UPSTREAM_KEYS.items()
        if alias in tier_keys
    }
    try:
        return TierConfig.from_dict(
            keys,
            dp_rank=dp_rank,
            environ=environ,
            host_env=HOST_ENV,
            port_env=PORT_ENV,
            also_accepted=(*ENTRY_KEYS, *UPSTREAM_KEYS, IDLE_WAIT_KEY),
            shown_as=aliases,
        )
    except ConfigError as exc:
        raise ConfigError(f"{ENTRY_CONTEXT}{exc}") from None


UPSTREAM_TYPE = "p2p"
"""The ``type`` of vLLM's built-in P2P tier; p2pkv builds it in zero-edit mode
(``P2PKV_REPLACE_P2P=1``, see :mod:`p2pkv_vllm.registration`)."""
REPLACE_ENV = "P2PKV_REPLACE_P2P"
"""Set to 1 on an engine to build p2pkv's tier for ``"type": "p2p"`` entries."""
_YES = ("1", "true", "yes", "on")
_NO = ("", "0", "false", "no", "off")


def replace_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`REPLACE_ENV` asks for zero-edit mode (the engine's registration and
    ``p2pkv check-config`` both ask here); ``ConfigError`` for a value that is neither yes
    nor no."""
    value = (os.environ if environ is None else environ).get(REPLACE_ENV, "").strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    raise ConfigError(
        f"{REPLACE_ENV}={value!r}: set it to 1 to build p2pkv's tier for "
        f'"type": "p2p" entries, or unset it'
    )


_CURVE_OPTIONS = ("server_secret_key", "client_secret_key", "allowed_client_keys", "insecure")


def zero_edit_keys(tier_keys: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of an entry written for vLLM's built-in tier, as p2pkv builds it: that tier
    authenticates nobody, so unless the entry gives zmq CURVE keys (or says ``insecure``
    itself) or ``$P2PKV_CURVE_DIR`` names the fleet's keys, p2pkv's zmq control runs
    ``insecure`` too, which it warns about at every start (docs/security.md says how to add
    keys)."""
    keys = dict(tier_keys)
    options = keys.get("control_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    if (
        keys.get("control", "zmq") == "zmq"
        and not any(k in options for k in _CURVE_OPTIONS)
        and not _fleet_keys_mounted()
    ):
        options["insecure"] = True
        keys["control_options"] = options
    return keys


def _fleet_keys_mounted() -> bool:
    """``$P2PKV_CURVE_DIR`` is set (the zmq transport then takes its keys from there); False
    without the zmq transport installed (the tier then fails naming it)."""
    try:
        from p2pkv_zmq.options import CURVE_DIR_ENV
    except ImportError:
        return False
    return bool(os.environ.get(CURVE_DIR_ENV))


def upstream_keys_mapped(tier_keys: Mapping[str, Any]) -> dict[str, Any]:
    """``tier_keys`` with the built-in tier's keys (:data:`UPSTREAM_KEYS`) moved to where
    p2pkv keeps them. ``ConfigError`` when one is also set the p2pkv way to another value,
    or names a NIXL setting while the entry's data transport is not nixl."""
    keys = dict(tier_keys)
    for alias, (section, name) in UPSTREAM_KEYS.items():
        if alias not in keys:
            continue
        value = keys.pop(alias)
        if section == "data_options" and keys.get("data", "nixl") != "nixl":
            raise ConfigError(
                f"{ENTRY_CONTEXT}{alias!r} is a NIXL setting "
                f"of vLLM's p2p tier, but data is {keys['data']!r}: set that "
                f"transport's data_options instead"
            )
        inner = keys.get(section)
        inner = dict(inner) if isinstance(inner, Mapping) else {}
        if name in inner and inner[name] != value:
            raise ConfigError(
                f"{ENTRY_CONTEXT}{alias!r} ({value!r}) and "
                f"{section}.{name} ({inner[name]!r}) disagree: keep one"
            )
        inner[name] = value
        keys[section] = inner
    return keys


IDLE_WAIT_KEY = "idle_wait"
"""Adapter key, vLLM before 0.33: the longest wait for a peer's frame while the engine sleeps
(default 0.25 s, :mod:`p2pkv_vllm.idle`); 0: an idle engine does not answer peers until its
next request."""


def idle_wait_of(tier_keys: dict[str, Any], default: float) -> float:
    """Pop :data:`IDLE_WAIT_KEY` from ``tier_keys``; ``ConfigError`` unless it is a number
    of seconds from 0 to 1."""
    value = tier_keys.pop(IDLE_WAIT_KEY, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(
            f"P2PKVTier: {IDLE_WAIT_KEY} must be seconds from 0 to 1 (0 turns "
            f"idle serving off), got {value!r}"
        )
    return float(value)


def check_engine_keys(*, locality: Any) -> str | None:
    """The adapter's check of ``locality``, a key vLLM itself reads: ``ConfigError`` unless
    it is one of :data:`LOCALITIES`; returns the locality (None when unset). A
    ``backpressure`` block is vLLM's to read and is accepted (see
    :mod:`p2pkv_vllm.backpressure` for what it may drop)."""
    if locality is not None and locality not in LOCALITIES:
        raise ConfigError(f"P2PKVTier: locality {locality!r} is not one of {', '.join(LOCALITIES)}")
    return None if locality is None else str(locality)


def entry_tier_config(
    entry: Mapping[str, Any],
    *,
    extra_config: Mapping[str, Any],
    dp_rank: int,
    environ: Mapping[str, str] | None = None,
) -> TierConfig:
    """The ``TierConfig`` that ``P2PKVTier`` builds from one ``secondary_tiers`` entry, without
    vLLM (``p2pkv check-config``): the same key checks and messages (``extra_config`` is
    vLLM's to read: its ``backpressure`` is accepted, as in the entry). The fingerprint is
    left empty (it needs the engine's model) and the hash seed is ``PYTHONHASHSEED`` or
    empty."""
    keys = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    if entry.get("type") == UPSTREAM_TYPE:
        keys = zero_edit_keys(keys)
    idle_wait_of(keys, 0.0)
    check_engine_keys(locality=entry.get("locality"))
    return tier_config_from_keys(
        keys,
        dp_rank=dp_rank,
        run_config={},
        hash_seed=resolve_hash_seed("", environ),
        environ=environ,
    )


def resolve_hash_seed(engine_seed: str, environ: Mapping[str, str] | None = None) -> str:
    """The seed vLLM derives block hashes from: ``PYTHONHASHSEED`` if set, else the engine's.

    vLLM builds the tier before it seeds its block hashes, so ``engine_seed`` (vLLM's
    ``get_none_hash_seed()`` at construction) is its cryptographic-hash default; the adapter
    re-checks once the engine runs (see ``P2PKVTier``).
    """
    env = os.environ if environ is None else environ
    return env.get("PYTHONHASHSEED") or engine_seed


def context_of(req_context: Any) -> RequestContext:
    """The one p2pkv context of a vLLM request, kept in the request's own scratch state.

    vLLM's ``ReqContext`` stores per-type state (``set_state``/``get_state``), so the p2pkv
    context lives and dies with the vLLM request and needs no table of its own.
    """
    ctx: RequestContext | None = req_context.get_state(RequestContext)
    if ctx is None:
        ctx = RequestContext(req_context.req_id, req_context.kv_transfer_params)
        req_context.set_state(ctx)
    return ctx


def preconnect_peers(params: Any, req_id: str = "") -> list[str]:
    """The ``host:port`` of every peer the pre-connect hint of ``params`` (a request's
    ``kv_transfer_params``) names, in order, duplicates dropped; ``[]`` without a hint. A
    malformed peer (or hint) is logged at WARNING and skipped: a hint never fails its
    request."""
    hint = params.get(PRECONNECT_KEY) if isinstance(params, Mapping) else None
    if hint is None:
        return []
    if not isinstance(hint, list):
        _log.warning(
            "request %s: %s must be a list of peers, got %s (ignored)",
            req_id or "?",
            PRECONNECT_KEY,
            type(hint).__name__,
        )
        return []
    if len(hint) > MAX_PRECONNECT:
        _log.warning(
            "request %s: %s names %d peers; connecting to the first %d",
            req_id or "?",
            PRECONNECT_KEY,
            len(hint),
            MAX_PRECONNECT,
        )
    peers: dict[str, None] = {}
    for peer in hint[:MAX_PRECONNECT]:
        address = _peer_address(peer)
        if address is None:
            _log.warning(
                "request %s: %s peer %r is not {remote_host: str, remote_port: 1..65535} (ignored)",
                req_id or "?",
                PRECONNECT_KEY,
                peer,
            )
        else:
            peers[address] = None
    return list(peers)


def _peer_address(peer: Any) -> str | None:
    if not isinstance(peer, Mapping):
        return None
    host, port = peer.get("remote_host"), peer.get("remote_port")
    if isinstance(port, str) and port.isdecimal():
        port = int(port)
    if (
        not isinstance(host, str)
        or not host.strip("[]")
        or isinstance(port, bool)
        or not isinstance(port, int)
        or not 0 < port < 65536
    ):
        return None
    return format_address(host, port)


def slots_of(transfer_job: Any) -> Any:
    """A vLLM transfer job's primary-tier slots (a numpy array): ``chunk_ids`` of a
    ``TransferJob`` (vLLM 0.30 and later), ``block_ids`` of a ``JobMetadata`` (0.27.1)."""
    slots = getattr(transfer_job, "chunk_ids", None)
    return transfer_job.block_ids if slots is None else slots


def job_of(transfer_job: Any, ctx: RequestContext) -> Job:
    """A vLLM ``TransferJob`` as a p2pkv ``Job``.

    Its slots (a numpy array) are passed as is: ``P2PTier`` normalises the block ids of
    submitted jobs itself, so they are converted exactly once.
    """
    keys = transfer_job.keys
    return Job(
        job_id=transfer_job.job_id,
        keys=keys if isinstance(keys, Sequence) else list(keys),
        block_ids=slots_of(transfer_job),
        is_load=bool(transfer_job.is_promotion),
        ctx=ctx,
    )


class ParentHitSource:
    """``p2pkv.tier.LocalHitSource`` over vLLM's ``ParentManager`` (symmetric serving).

    Each served remote request gets a synthetic vLLM request context with a unique id (vLLM
    keys per-request state by id). Used only during a ``serve_external_requests`` call that
    passed its parent (:meth:`over`), like the parent itself; it keeps no state of its own
    between calls, so one serves every call with the same parent.
    """

    def __init__(
        self,
        parent: Any,
        *,
        new_context: Callable[[str], Any],
        results: Mapping[Any, LookupResult],
        serial: itertools.count[int],
    ) -> None:
        self._parent = parent
        self._new_context = new_context
        self._results = results
        self._serial = serial

    def over(self, parent: Any) -> bool:
        """Whether this source wraps ``parent``."""
        return self._parent is parent

    def begin(self, kv_request_id: str) -> object:
        req_context = self._new_context(f"p2pkv-serve-{next(self._serial)}-{kv_request_id}")
        self._parent.on_new_request(req_context)
        return req_context

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        """HIT and MISS as the parent says; anything pending (HIT_PENDING, RETRY) is RETRY."""
        return self._results.get(self._parent.lookup(key, handle), LookupResult.RETRY)

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        """The parent's store job over ``keys`` (block ids as plain ints: pinned jobs are not
        normalised by the tier)."""
        transfer_job = self._parent.create_store_job(keys, handle)
        return Job(
            transfer_job.job_id,
            list(transfer_job.keys),
            slots_of(transfer_job).tolist(),
            False,
            context_of(handle),
        )

    def end(self, handle: object) -> None:
        self._parent.on_request_finished(handle)


class FailedLoadLog:
    """WARNING lines for failed loads, at most one per (outcome, peer) per ``window`` seconds.

    A failed load costs the request a recompute of those blocks, so the operator sees it at
    the default log level; a flood of them (a dead prefiller fails every pending load at
    once) logs one line per kind, and the next line of that kind after the window says how
    many were folded into it.
    """

    def __init__(
        self,
        logger: logging.Logger,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._window = window
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._folded: dict[tuple[str, str], int] = {}

    def failed(self, result: JobResult, ctx: RequestContext) -> None:
        """Log (or count) one failed load of request ``ctx``."""
        route = ctx.routing.consumer if isinstance(ctx.routing, Routing) else None
        peer = route.peer if route is not None else "?"
        kind = (result.outcome.value, peer)
        now = self._clock()
        if now - self._last.get(kind, -self._window) < self._window:
            self._folded[kind] = self._folded.get(kind, 0) + 1
            return
        self._last[kind] = now
        folded = self._folded.pop(kind, 0)
        more = f" ({folded} more like it since the last such line)" if folded else ""
        self._log.warning(
            "P2PKVTier load from %s failed (%s) for request %s: vLLM recomputes its blocks%s%s",
            peer,
            result.outcome.value,
            ctx.req_id,
            f": {result.detail}" if result.detail else "",
            more,
        )
