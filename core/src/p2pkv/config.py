"""``TierConfig``: a tier config dict, environment defaults and the data-parallel port offset.

Precedence for ``host`` and ``port``: explicit key > environment variable > built-in default.
The bound port is ``base port + dp_rank``. Every rejection is a ``ConfigError`` that names the
key and what would be valid (:mod:`p2pkv.options` reads the keys).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from p2pkv.addressing import format_address, parse_address
from p2pkv.errors import ConfigError
from p2pkv.options import derived, option, parse_options, shown
from p2pkv.peer_allow import SERVICE_NEVER_MATCHES, parse_allow_list, service_allowed

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5710
HOST_ENV = ("P2PKV_HOST",)
PORT_ENV = ("P2PKV_PORT",)
VLLM_HOST_ENV = ("VLLM_P2P_SIDE_CHANNEL_HOST", *HOST_ENV)
"""The host variables under vLLM, first set one wins (vLLM's name first): what the vLLM
adapter reads, and ``p2pkv probe`` with no address."""
VLLM_PORT_ENV = ("VLLM_P2P_SIDE_CHANNEL_PORT", *PORT_ENV)
"""The base-port variables under vLLM (the bound port is base + DP rank)."""
PEERS_ALLOW_ENV = "P2PKV_PEERS_ALLOW"
PEERS_CONNECT_ENV = "P2PKV_PEERS_CONNECT"
PEERS_MAX_DIALED_ENV = ("P2PKV_PEERS_MAX_DIALED", "VLLM_P2P_MAX_PEERS")
PEERS_WARM_ENV = ("P2PKV_PEERS_WARM",)
"""First set wins; ``VLLM_P2P_MAX_PEERS`` is the cap vLLM's built-in tier reads once its
fix for GHSA-frvg-qw88-hww9 lands (there it counts every peer, here dialed ones)."""
PEERS_IDLE_TIMEOUT_ENV = ("P2PKV_PEERS_IDLE_TIMEOUT", "VLLM_P2P_IDLE_TIMEOUT_S")
"""First set wins (``VLLM_P2P_IDLE_TIMEOUT_S``: the same fix's idle reaping, in seconds)."""
HANDSHAKE_TIMEOUT_ENV = ("P2PKV_HANDSHAKE_TIMEOUT", "VLLM_P2P_HANDSHAKE_TIMEOUT_S")
"""``timeouts.handshake`` when the tier entry has none; first set wins."""


MAX_SECONDS = 86400.0
"""Upper bound of every timeout and interval of the tier (a day): no KV transfer waits that
long, and a bound keeps every deadline and the hello's ``lease_ms`` finite."""
MAX_COUNT = 2**31 - 1
"""Upper bound of every count and size of the tier (what a C ``int`` holds)."""
_SECONDS = option(gt=0, le=MAX_SECONDS, unit="seconds")
_COUNT = option(gt=0, le=MAX_COUNT)


@dataclass(frozen=True)
class Timeouts:
    """Deadlines in seconds. Every wait in the tier is bounded by one of these."""

    handshake: float = field(default=10.0, metadata=_SECONDS)
    """A connected peer must complete the hello exchange within this (a dial to a
    black-holed address holds its sockets until then). Env ``P2PKV_HANDSHAKE_TIMEOUT``
    (else ``VLLM_P2P_HANDSHAKE_TIMEOUT_S``) when the entry has no ``timeouts.handshake``."""
    load: float = field(default=30.0, metadata=_SECONDS)
    """A load whose blocks have not all arrived by then fails ``load_timeout`` (its reads are
    cancelled first, finally: the slots are free again the moment the result is out)."""
    lease_margin: float = field(default=10.0, metadata=_SECONDS)
    """The producer pins a round's source blocks for the lease, ``load + lease_margin``, from
    each ``ready`` (or until the consumer's ``release``). The consumer accepts a read only if
    it completed within the lease of the moment it *sent* the fetch, on its own clock; with
    the lease above ``load`` that rejects only a consumer that was itself paused past it."""
    store: float = field(default=30.0, metadata=_SECONDS)
    """A store bound to a consumer but not finished by then fails."""
    unbound_store: float = field(default=60.0, metadata=_SECONDS)
    """A store whose consumer never asked for it fails after this."""
    lookup: float = field(default=5.0, metadata=_SECONDS)
    """A producer answers MISS for lookups its hit source has not settled by then."""
    shutdown_drain: float = field(default=5.0, metadata=_SECONDS)
    """Shutdown waits this long for sessions to wind down (consumers' releases, internal
    transfers of the data transport) before closing them anyway."""

    @property
    def lease(self) -> float:
        """How long a ``ready`` pins the producer's source blocks (``load + lease_margin``)."""
        return self.load + self.lease_margin


@dataclass(frozen=True)
class Limits:
    """Caps on what a peer may send; exceeding one is a protocol error."""

    max_frame_bytes: int = field(default=64 * 1024 * 1024, metadata=_COUNT)
    """Largest control frame accepted or sent."""
    max_keys_per_message: int = field(default=65536, metadata=_COUNT)
    """Most keys (blocks) in one fetch, lookup or lookup response."""
    max_key_bytes: int = field(default=1024, metadata=_COUNT)
    """Longest block key."""
    max_request_id_chars: int = field(default=256, metadata=_COUNT)
    """Longest ``kv_request_id``."""
    max_descriptor_bytes: int = field(default=16 * 1024 * 1024, metadata=_COUNT)
    """Largest data-transport descriptor in a hello."""
    max_consecutive_internal_errors: int = field(default=5, metadata=_COUNT)
    """Internal errors in a row while handling one peer's messages before its session is closed."""


@dataclass(frozen=True)
class Flow:
    """Flow control (docs/configuration.md, "Flow control"): how much work the tier keeps in
    flight with one peer; work beyond it waits in the tier, in order, each job within its own
    deadline. Per tier, not negotiated: peers may differ."""

    window_rounds: int = field(default=32, metadata=_COUNT)
    """Load rounds (fetches) a consumer keeps open with one producer at once; later loads
    wait in the tier, PD loads (``remote_prefiller``) before prefix pulls
    (``remote_kv_source``), each first come first served, until a round ends."""
    window_blocks: int = field(default=4096, metadata=_COUNT)
    """Blocks of those rounds open at once with one producer (what it pins for us); a round
    larger than this goes alone."""
    max_held_frames: int = field(default=65536, metadata=_COUNT)
    """Control frames a session holds for a peer whose send queue is full (back-pressure:
    they go out in order as it drains). Beyond this the peer is not reading at all and the
    session closes (``peer_dead``)."""


@dataclass(frozen=True)
class Peers:
    """Which peers requests may make this tier dial (:mod:`p2pkv.dial_policy`). Keys absent
    here are read from ``P2PKV_PEERS_ALLOW`` (comma-separated) and
    ``P2PKV_PEERS_MAX_DIALED`` (else ``VLLM_P2P_MAX_PEERS``), for deployments that cannot
    edit the tier entry; so are ``connect``, ``idle_timeout`` and ``warm`` (named at each)."""

    allow: tuple[str, ...] = ()
    """Networks, addresses or host names the tier may dial; empty: any peer."""
    max_dialed: int = field(default=256, metadata=_COUNT)
    """Sessions this tier dialed for requests that may be open at once (each holds 3 zmq
    sockets of the control transport's context, whose cap follows ``ulimit -n``); a new peer
    beyond it takes the place of a dial that made no progress or of an idle session, else
    waits or is refused. A quarter of it bounds new dials a second and dials that heard
    nothing; as many peers may wait for a dial."""
    connect: tuple[str, ...] = ()
    """``host:port`` of peers to keep sessions to before any request names them; a host
    name is resolved every ``resolve_interval`` (a headless Service: every pod). Env
    ``P2PKV_PEERS_CONNECT`` (comma-separated)."""
    resolve_interval: float = field(default=30.0, metadata=_SECONDS)
    """Seconds between resolutions of ``connect``'s names (and re-dials of ended sessions)."""
    idle_timeout: float = field(
        default=300.0, metadata=option(ge=0, le=MAX_SECONDS, unit="seconds")
    )
    """A session this tier dialed that carried nothing for this long is closed (its sockets
    and data peer freed; the next request naming the peer dials again). Sessions to
    ``connect``'s peers are kept. 0: never. Env ``P2PKV_PEERS_IDLE_TIMEOUT`` (else
    ``VLLM_P2P_IDLE_TIMEOUT_S``)."""
    warm: int = field(default=32, metadata=option(ge=0))
    """Peers of ``connect`` kept connected at most (the warm set): those requests named
    most recently, filled up with a random sample. Warm sessions do not count in
    ``max_dialed``. 32 keeps the full mesh of every fleet the field runs today (16 pods,
    3 x DP8) and a bounded set beyond. 0: pre-connect nothing. Env ``P2PKV_PEERS_WARM``."""
    max_handshakes: int = field(default=16, metadata=_COUNT)
    """Pre-connect dials of this tier in their handshake at once (requests' dials never wait
    for it): many tiers starting together spread their dials."""
    dial_backoff: float = field(default=10.0, metadata=_SECONDS)
    """The longest wait, in seconds, before an address whose dial failed is dialed again
    (from 1 s, doubling per failure in a row); requests naming it meanwhile are refused at
    once (unless only pre-connect's dial failed)."""


def _setting(key: str, source: str, env_names: Sequence[str]) -> str:
    """How to change ``key`` given where its value came from (``source``)."""
    if source.startswith("environment variable"):
        return f"the {source} (it set this {key}; the tier config key {key!r} overrides it)"
    if source == "default":
        return f"the tier config key {key!r} or the environment variable {env_names[0]}"
    return f"the tier config key {key!r}"


@dataclass(frozen=True)
class TierConfig:
    """A validated tier config. Build it with :meth:`from_dict`; its keys are the fields not
    marked ``derived`` (:func:`p2pkv.options.option_keys`)."""

    tier_type: str = field(default="", metadata=option(key="type"))
    """The tier's type name, read by the engine (vLLM: ``"P2PKVTier"``, with
    ``module_path``); p2pkv only checks that it is a string."""
    control: str = "zmq"
    """Control transport name (``p2pkv plugins`` lists what is installed)."""
    data: str = "nixl"
    """Data transport name."""
    host: str = field(default=DEFAULT_HOST, metadata=option(nonblank=True))
    """Host to bind and advertise; env ``P2PKV_HOST``. Non-loopback needs authentication."""
    base_port: int = field(default=DEFAULT_PORT, metadata=option(key="port"))
    """Base control port (key ``port``; env ``P2PKV_PORT``); the bound port adds ``dp_rank``.
    0 = ephemeral."""
    dp_rank: int = field(default=0, metadata=derived())
    """Data-parallel rank (given by the engine, not a config key)."""
    control_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of the control transport (see Transports)."""
    data_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of the data transport (see Transports)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Deadlines, below."""
    limits: Limits = field(default_factory=Limits)
    """Caps on what peers may send, below."""
    flow: Flow = field(default_factory=Flow)
    """Flow-control windows, below."""
    peers: Peers = field(default_factory=Peers)
    """Which peers requests may make the tier dial, below."""
    fingerprint: str = ""
    """Model/run fingerprint; peers with different non-empty fingerprints are rejected."""
    hash_seed: str = ""
    """Block-hash seed; peers with a different seed are rejected at handshake."""
    host_setting: str = field(default=_setting("host", "default", HOST_ENV), metadata=derived())
    """How an operator changes ``host`` here (derived, not a key): the variable in force."""
    port_setting: str = field(default=_setting("port", "default", PORT_ENV), metadata=derived())
    """How an operator changes the base port here (derived, not a key): under vLLM it names
    ``VLLM_P2P_SIDE_CHANNEL_PORT``, which overrides ``P2PKV_PORT``."""

    @property
    def port(self) -> int:
        """The port this tier binds: base port + data-parallel rank (0 stays 0: ephemeral)."""
        return self.base_port + self.dp_rank if self.base_port else 0

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any] | None = None,
        *,
        dp_rank: int = 0,
        environ: Mapping[str, str] | None = None,
        host_env: Sequence[str] = HOST_ENV,
        port_env: Sequence[str] = PORT_ENV,
        also_accepted: tuple[str, ...] = (),
        shown_as: Mapping[str, str] | None = None,
    ) -> TierConfig:
        """Validate a tier config dict: its keys, then ``host``/``port`` from the environment
        where the dict has none, then the port of this data-parallel rank.

        ``host_env``/``port_env`` name the environment variables consulted, first match wins
        (engine adapters put their own names first). ``environ`` defaults to ``os.environ``.
        ``also_accepted`` and ``shown_as`` go to :func:`p2pkv.options.parse_options`: keys an
        adapter reads itself (listed as valid), and the names the operator wrote for keys an
        adapter moved (named in messages).
        """
        keys: Mapping[str, Any] = {} if d is None else d
        parsed = parse_options(
            cls, keys, "tier config key", also_accepted=also_accepted, shown_as=shown_as
        )
        env = os.environ if environ is None else environ
        if "host" in keys:
            host, host_source = parsed.host, "key 'host'"
        else:
            host, host_source = _from_env(env, host_env, DEFAULT_HOST)
        if "port" in keys:
            base_port, port_source = parsed.base_port, "key 'port'"
        else:
            base_port, port_source = _env_port(env, port_env)
        _check_port(base_port, dp_rank, port_source)
        return replace(
            parsed,
            host=host,
            base_port=base_port,
            dp_rank=dp_rank,
            timeouts=_timeouts_from_env(parsed.timeouts, keys.get("timeouts"), env),
            peers=_peers_from_env(parsed.peers, keys.get("peers"), env),
            host_setting=_setting("host", host_source, host_env),
            port_setting=_setting("port", port_source, port_env),
        )


def _env_number(
    env: Mapping[str, str],
    names: Sequence[str],
    what: str,
    *,
    zero_ok: bool = False,
    integer: bool = False,
) -> float | None:
    """The number the first set of ``names`` holds, or None; ``ConfigError`` naming the
    variable if it is not a number in range (> 0, or >= 0 with ``zero_ok``; with
    ``integer``, an integer, from 1 or with ``zero_ok`` from 0)."""
    text, source = _from_env(env, names, "")
    if not text.strip():
        return None
    variable = source.removeprefix("environment variable ")
    if integer:
        digits = text.strip()
        least = 0 if zero_ok else 1
        if not digits.isdigit() or len(digits) > 10 or not least <= int(digits) <= MAX_COUNT:
            raise ConfigError(
                f"{variable}={shown(text)} must be an integer in {least}..{MAX_COUNT} ({what})"
            )
        return int(digits)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS:
        low = "from 0" if zero_ok else "above 0"
        raise ConfigError(
            f"{variable}={shown(text)} must be a number {low}, at most {MAX_SECONDS:g} ({what})"
        )
    return value


def _timeouts_from_env(timeouts: Timeouts, raw: Any, env: Mapping[str, str]) -> Timeouts:
    """``timeouts`` with ``handshake`` from the environment if its entry lacks it."""
    given = raw if isinstance(raw, Mapping) else {}
    seconds = (
        None
        if "handshake" in given
        else _env_number(env, HANDSHAKE_TIMEOUT_ENV, "seconds a peer has to complete the handshake")
    )
    return timeouts if seconds is None else replace(timeouts, handshake=seconds)


def _peers_from_env(peers: Peers, raw: Any, env: Mapping[str, str]) -> Peers:
    """``peers`` with the keys its entry lacks taken from the environment."""
    given = raw if isinstance(raw, Mapping) else {}
    values: dict[str, Any] = {}
    from_env: dict[str, str] = {}
    for key, name in (("allow", PEERS_ALLOW_ENV), ("connect", PEERS_CONNECT_ENV)):
        listed = env.get(name, "")
        if key not in given and listed.strip():
            values[key] = [part.strip() for part in listed.split(",") if part.strip()]
            from_env[key] = name
    numbers = (  # key, variables, what it is, zero allowed, an integer
        ("max_dialed", PEERS_MAX_DIALED_ENV, "sessions this tier may dial", False, True),
        (
            "idle_timeout",
            PEERS_IDLE_TIMEOUT_ENV,
            "seconds before an unused dialed session closes; 0: never",
            True,
            False,
        ),
        ("warm", PEERS_WARM_ENV, "peers of connect kept connected; 0: none", True, True),
    )
    for key, names, what, zero_ok, integer in numbers:
        value = (
            None
            if key in given
            else _env_number(env, names, what, zero_ok=zero_ok, integer=integer)
        )
        if value is not None:
            values[key] = value
    if values:
        peers = parse_options(Peers, {**given, **values}, "tier config key")
    parse_allow_list(peers.allow, from_env.get("allow"))  # refuses a bad entry now, naming it
    hosts = []
    for i, entry in enumerate(peers.connect):
        where = (
            f"{PEERS_CONNECT_ENV} entry {entry!r}"
            if "connect" in from_env
            else f"tier config key peers.connect[{i}]"
        )
        if "$(" in entry:
            raise ConfigError(
                f"{where} holds a $(VAR) reference Kubernetes did not expand: "
                "define VAR above this variable in the container's env list "
                "(only earlier ones expand)"
            )
        try:
            hosts.append(parse_address(entry)[0])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    service = service_allowed(peers.allow, hosts)
    if service is not None:
        i, host = service
        variable, entry = from_env.get("allow"), peers.allow[i]
        where = f"{variable} entry" if variable else f"tier config key peers.allow[{i}] ="
        raise ConfigError(
            f"{where} {entry!r} names the Service peers.connect dials ({host}), "
            f"{SERVICE_NEVER_MATCHES}"
        )
    return peers


def config_fingerprint(fields_: Mapping[str, Any]) -> str:
    """16 hex chars identifying a model/run config; empty fields give "" (matches anyone)."""
    if not fields_:
        return ""
    blob = json.dumps(dict(fields_), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _from_env(env: Mapping[str, str], names: Sequence[str], default: str) -> tuple[str, str]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return str(value), f"environment variable {name}"
    return default, "default"


def _env_port(env: Mapping[str, str], names: Sequence[str]) -> tuple[int, str]:
    text, source = _from_env(env, names, str(DEFAULT_PORT))
    try:
        return int(text), source
    except ValueError:
        raise ConfigError(f"{source}: port must be an integer, got {text!r}") from None


def _check_port(base_port: int, dp_rank: int, source: str) -> None:
    """The bound port ``base_port + dp_rank`` is a port (or ``base_port`` 0: ephemeral)."""
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise ConfigError(f"dp_rank must be a non-negative integer, got {dp_rank!r}")
    if base_port != 0 and not 0 < base_port + dp_rank < 65536:
        raise ConfigError(
            f"{source}: port {base_port} + data-parallel rank {dp_rank} = "
            f"{base_port + dp_rank} is outside 1..65535"
        )
    if base_port < 0:
        raise ConfigError(f"{source}: port must be >= 0 (0 = ephemeral)")
