"""``p2pkv check-config``: validate an engine's tier config before the engine starts.

Takes the ``--kv-transfer-config`` JSON exactly as the operator passes it to vLLM (and the
same ``--data-parallel-size``), plus this process's environment (``VLLM_P2P_SIDE_CHANNEL_*``,
``P2PKV_*``, ``PYTHONHASHSEED``), and checks every ``secondary_tiers`` entry that names a
p2pkv engine adapter (``"module_path": "p2pkv_vllm"``) the way the tier will at engine start:

- the adapter's own keys (``backpressure``, ``locality``, unknown keys) and the tier keys,
  with the adapter's messages (``p2pkv_vllm.bridge.entry_tier_config``, which needs no vLLM);
- the port of every DP rank (base + rank within 1..65535);
- the transports: names, libraries, options, key files and the bind host, by building the
  tier itself (``P2PTier``) on an ephemeral port of the configured host and closing it, so
  the messages are the tier's own.

Run it on the engine's host, in the engine's environment. Off the pod, ``--env NAME=VALUE``
sets the pod's variables, ``$(NAME)`` references in the JSON and in those values expand as
Kubernetes expands them (``--pod-ip`` sets ``$(POD_IP)``; a reference left unset becomes the
placeholder address :data:`PLACEHOLDER_ADDRESS`, said on stderr), and ``--no-bind`` skips
what only the pod can do: listening on its address (every other check still runs).

Each entry that would start gets an ``ok`` line naming its transports, ports, security and
peer policy (the last two as the engine's start line words them), and the zmq socket cap
with where it came from (``control_options.max_sockets``, or derived from ``ulimit -n``).

Exit status: 0 when every entry would start (hints, e.g. an unset ``PYTHONHASHSEED``, go to
stderr); 1 when the config is valid but runs no p2pkv tier (vLLM's built-in P2P tier, a
connector or spec that never reads ``secondary_tiers``); 2 when the config cannot work or
cannot be read: the tier would refuse it (one line on stderr: the entry and the tier's
message), its peers would need more zmq sockets than the context has, the JSON is not an
object or holds an unreadable number, it has no p2pkv entry, p2pkv-vllm is missing, a bad
flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from p2pkv.cli_support import print_error
from p2pkv.config import TierConfig
from p2pkv.errors import ConfigError, P2PKVError
from p2pkv.json_option import json_object, option_text
from p2pkv.registry import default_registry

ADAPTERS = {"p2pkv_vllm": "p2pkv_vllm.bridge"}
"""``module_path`` of an engine's tier entry -> the vLLM-free module that turns the entry into
a ``TierConfig`` (``entry_tier_config``) and names the tier class (``TIER_TYPE``)."""
_INSTALL = {"p2pkv_vllm": "p2pkv-vllm"}
_SUMMARIES = {"p2pkv_vllm.bridge": "p2pkv_vllm.start_line"}
"""Adapter bridge -> the module whose ``security_and_peers`` words the start line: the ok
line says security and peers exactly as the engine's start line will."""
_PROBE_BLOCK = 4096
PLACEHOLDER_ADDRESS = "192.0.2.1"
"""What an unset ``$(VAR)`` becomes off the pod: an address reserved for documentation
(RFC 5737), never a real peer."""
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_POD_ONLY = (
    "listening on the tier's address and port",
    "the key files as the pod mounts them",
    "the transports' libraries as the image has them",
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One p2pkv ``secondary_tiers`` entry of the config."""

    index: int
    keys: Mapping[str, Any]
    adapter: Any
    """The adapter's bridge module (see :data:`ADAPTERS`)."""
    how: str = ""
    """Why vLLM builds p2pkv's tier for it (module_path, a registered type, zero-edit)."""

    @property
    def where(self) -> str:
        return f"secondary_tiers[{self.index}]"

    def says(self, exc: BaseException) -> str:
        """``exc``'s message, prefixed with :attr:`where` instead of the adapter's own name
        for the entry (its ``ENTRY_CONTEXT``, which an engine's log needs and this does not)."""
        context = getattr(self.adapter, "ENTRY_CONTEXT", "")
        return f"{self.where}: {str(exc).removeprefix(context)}"


class BuiltInTier(P2PKVError):
    """The config is vLLM's built-in P2P tier without the opt-in: valid, but vLLM would not
    build p2pkv's tier (exit 1, like a connector that never reads the tiers)."""


REPLACE_ENV = "P2PKV_REPLACE_P2P"
"""p2pkv-vllm's opt-in: ``"type": "p2p"`` entries build p2pkv's tier (zero-edit mode)."""
_TYPES = {"p2pkv": "p2pkv_vllm", "P2PKVTier": "p2pkv_vllm"}
"""Tier types p2pkv-vllm registers with vLLM's factory (its vLLM general plugin) -> the
adapter that builds them, on every release (with or without ``module_path``)."""
_UPSTREAM = "p2p"


def _replacing(environ: Mapping[str, str]) -> bool:
    """Whether the engine would build p2pkv's tier for ``"type": "p2p"``: p2pkv-vllm's own
    reading of :data:`REPLACE_ENV` (``ConfigError`` for a garbled value, as at engine
    start); False without p2pkv-vllm."""
    try:
        adapter = importlib.import_module(ADAPTERS["p2pkv_vllm"])
    except ModuleNotFoundError:
        return False
    return bool(adapter.replace_requested(environ))


def _adapter_of(keys: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(adapter module_path, why) when vLLM would build p2pkv's tier for this entry."""
    module_path, tier_type = keys.get("module_path"), keys.get("type")
    if module_path in ADAPTERS:
        return str(module_path), f"module_path {module_path!r}"
    if module_path is None and tier_type in _TYPES:
        return _TYPES[tier_type], f"type {tier_type!r}, registered by p2pkv-vllm's vLLM plugin"
    if module_path is None and tier_type == _UPSTREAM and _replacing(environ):
        return "p2pkv_vllm", f"type 'p2p' with {REPLACE_ENV}=1: zero-edit mode"
    return None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "check-config",
        help="validate vLLM's --kv-transfer-config for the p2pkv tier without starting vLLM",
        description="Check the p2pkv secondary tiers of a vLLM --kv-transfer-config (and this "
        "environment) as the tier will at engine start. Exit 2 if the tier would "
        "refuse it, 1 if it runs no p2pkv tier (vLLM's built-in one).",
    )
    p.add_argument(
        "--kv-transfer-config",
        required=True,
        metavar="JSON",
        help="the JSON given to vllm serve --kv-transfer-config",
    )
    p.add_argument(
        "--data-parallel-size",
        type=data_parallel_size,
        default=1,
        metavar="N",
        help="the engine's --data-parallel-size (ports base..base+N-1; default 1)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable of the pod's environment (repeatable); $(NAME) references "
        "expand as Kubernetes expands them",
    )
    p.add_argument(
        "--pod-ip",
        metavar="ADDRESS",
        help=f"the value of $(POD_IP) (default: the placeholder "
        f"{PLACEHOLDER_ADDRESS} when the config refers to it)",
    )
    p.add_argument(
        "--no-bind",
        action="store_true",
        help="off the pod: skip listening on the tier's address (only the pod can); "
        "every other check runs",
    )
    p.set_defaults(func=run)


def data_parallel_size(text: str) -> int:
    """An engine's ``--data-parallel-size`` given on the command line: 1..65535 (each rank
    has a port), else ``ArgumentTypeError`` quoting at most the first 20 characters."""
    try:
        value = int(text)
    except ValueError:  # not an integer, or more digits than Python reads
        value = 0
    if not 1 <= value <= 65535:
        shown = repr(text) if len(text) <= 20 else f"{text[:20]!r}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(
            f"must be an integer in 1..65535 (one port per data-parallel rank), got {shown}"
        )
    return value


def entries(
    kv_transfer_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[Mapping[str, Any], list[Entry]]:
    """The connector's extra config and its p2pkv tier entries; ``ConfigError`` when there
    are none or an adapter is missing (the engine would start without the tier, or fail)."""
    environ = os.environ if environ is None else environ
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    tiers = extra.get("secondary_tiers") if isinstance(extra, Mapping) else None
    if not isinstance(tiers, list):
        raise ConfigError(
            "kv_connector_extra_config.secondary_tiers is missing or not a list: "
            "add the tier as one entry of it (docs/vllm.md)"
        )
    found = []
    for index, keys in enumerate(tiers):
        built = _adapter_of(keys, environ) if isinstance(keys, Mapping) else None
        if built is None:
            continue
        module_path, how = built
        try:
            adapter = importlib.import_module(ADAPTERS[module_path])
        except ModuleNotFoundError as exc:  # the chain names the module (maybe a dependency)
            raise ConfigError(
                f"secondary_tiers[{index}] is built by {module_path!r}, which is "
                f"not installed: pip install {_INSTALL[module_path]}"
            ) from exc
        found.append(Entry(index, keys, adapter, how))
    if not found:
        upstream = [
            i for i, k in enumerate(tiers) if isinstance(k, Mapping) and k.get("type") == _UPSTREAM
        ]
        if upstream:
            raise BuiltInTier(
                f"secondary_tiers[{upstream[0]}] has type 'p2p': vLLM's built-in "
                f"P2P tier would be built, not p2pkv's; set {REPLACE_ENV}=1 on "
                f"the engines (and here) to build p2pkv's tier from it unedited"
            )
        raise ConfigError(
            f"no secondary_tiers entry has module_path "
            f"{' or '.join(map(repr, ADAPTERS))} or type "
            f"{' or '.join(map(repr, _TYPES))}: nothing for p2pkv to check"
        )
    return extra, found


def check(entry: Entry, extra: Mapping[str, Any], dp_size: int, *, bind: bool = True) -> TierConfig:
    """Check one entry for every DP rank, then build and close its tier once (port 0).
    Returns rank 0's config; raises ``P2PKVError`` (with the tier's message) or ``OSError``.
    ``bind=False``: a host that is not this machine's is not listened on (the transports,
    their options and keys are still checked; the control transport binds last)."""
    tier_type = entry.keys.get("type")
    if "module_path" in entry.keys and tier_type not in _TYPES:
        raise ConfigError(
            f"'type' is {tier_type!r}: vLLM loads the class named by 'type' from "
            f"module_path; use {entry.adapter.TIER_TYPE!r}"
        )
    configs: list[TierConfig] = [
        entry.adapter.entry_tier_config(entry.keys, extra_config=extra, dp_rank=rank)
        for rank in range(dp_size)
    ]
    from p2pkv.tier import P2PTier

    probe = dataclasses.replace(configs[0], base_port=0)
    guard_log = logging.getLogger("p2pkv.call_guard")
    level = guard_log.level
    guard_log.setLevel(logging.ERROR)  # a slow call of this throwaway tier serves no peer
    try:
        P2PTier(probe, memoryview(bytearray(_PROBE_BLOCK)), _PROBE_BLOCK).shutdown()
    except ConfigError as exc:
        if bind or getattr(exc.__cause__, "errno", None) != errno.EADDRNOTAVAIL:
            raise
    finally:
        guard_log.setLevel(level)
    return configs[0]


def expand(
    text: str, values: Mapping[str, str], unset: set[str], *, placeholder: bool = True
) -> str:
    """``text`` with each ``$(NAME)`` replaced by ``values[NAME]`` as Kubernetes expands a
    container's arguments (``$$`` is a literal ``$``); a name not in ``values`` is added to
    ``unset`` and becomes :data:`PLACEHOLDER_ADDRESS` (or stays as written without
    ``placeholder``, as the kubelet leaves it)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        if name not in values:
            unset.add(name)
            return PLACEHOLDER_ADDRESS if placeholder else match.group(0)
        return values[name]

    return _REFERENCE.sub(one, text)


def _pod_environment(args: argparse.Namespace, unset: set[str]) -> dict[str, str]:
    """The ``--env`` variables (and ``POD_IP`` from ``--pod-ip``), each value expanded
    against those before it, as Kubernetes does; ``ConfigError`` for a malformed one."""
    values: dict[str, str] = {}
    if args.pod_ip is not None:
        values["POD_IP"] = args.pod_ip
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE")
        values[name] = expand(value, values, unset)
    return values


def connector_problem(
    kv_transfer_config: Mapping[str, Any], extra: Mapping[str, Any]
) -> str | None:
    """Why vLLM would never build the tiers of this config (None if it would): only the
    OffloadingConnector with a tiering spec reads ``secondary_tiers``. An out-of-tree spec
    (``spec_module_path``) is taken to be a tiering spec."""
    connector = kv_transfer_config.get("kv_connector")
    if connector != "OffloadingConnector":
        return (
            f"kv_connector is {connector!r}: only the OffloadingConnector reads "
            f'secondary_tiers; set "kv_connector": "OffloadingConnector"'
        )
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if spec != "TieringOffloadingSpec" and "spec_module_path" not in extra:
        return (
            f"kv_connector_extra_config.spec_name is {spec!r}: only TieringOffloadingSpec "
            f'reads secondary_tiers; set "spec_name": "TieringOffloadingSpec"'
        )
    return None


def _refusal(entry: Entry, exc: BaseException) -> str:
    if getattr(exc.__cause__, "errno", None) == errno.EADDRNOTAVAIL:
        return (
            f"{entry.says(exc)} (not an address of this machine: run check-config on "
            f"the pod, or add --no-bind to check everything else here)"
        )
    return entry.says(exc)


def socket_budget(config: TierConfig) -> str:
    """The control transport's socket cap, as the ok line words it (empty for a transport
    without one). ``ConfigError`` when the sessions this tier may dial (``peers.max_dialed``
    plus the warm set) need more sockets than the cap: an absurd number, caught before the
    engine runs out under load. The cap is the transport's own, from the ``socket_cap``
    classmethod of its registered class (zmq's: derived from this process's ``ulimit -n``
    unless set, so off the pod it is this shell's limit, not the pod's); the sessions it
    holds are its ``sessions`` when it says (zmq keeps 16 sockets of its own), else the cap
    over the sockets a session holds."""
    transport = default_registry().transport("control", config.control)
    cap_of = getattr(transport, "socket_cap", None)
    if cap_of is None:
        return ""
    found = cap_of(config.control_options)
    cap, source, per_session = found
    room = getattr(found, "sessions", cap // per_session)  # after the transport's own sockets
    peers = config.peers
    sessions = peers.max_dialed + peers.warm
    if sessions <= room:
        return f", {config.control} sockets {cap} ({source})"
    raise ConfigError(
        f"peers.max_dialed {peers.max_dialed} + peers.warm {peers.warm} = {sessions} "
        f"dialed sessions of {per_session} {config.control} sockets each, above the {room} "
        f"the {config.control} context's cap of {cap} ({source}) holds: lower "
        f"peers.max_dialed (P2PKV_PEERS_MAX_DIALED) or peers.warm (P2PKV_PEERS_WARM) to a "
        f"sum of at most {room}, or raise control_options.max_sockets or ulimit -n"
    )


def _summary(entry: Entry, config: TierConfig) -> str:
    """``, security ..., peers ...`` as the engine's start line words them (empty for an
    adapter without such a line)."""
    module = _SUMMARIES.get(entry.adapter.__name__)
    if module is None:
        return ""
    return f", {importlib.import_module(module).security_and_peers(config)}"


def _hints(environ: Mapping[str, str]) -> list[str]:
    if environ.get("PYTHONHASHSEED") in (None, "", "random"):
        return [
            "PYTHONHASHSEED is unset or random: with a non-cryptographic "
            "prefix_caching_hash_algo no two instances ever match each other's blocks; "
            "set it to one value on every instance"
        ]
    return []


def _expanded_config(text: str, pod: Mapping[str, str], unset: set[str]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` (text or ``@file``) parsed after its ``$(NAME)``
    references expand, as the kubelet expands them before vLLM reads the JSON: an overlay's
    ``"port":$(VLLM_P2P_SIDE_CHANNEL_PORT)`` is JSON only once expanded. ``ConfigError``
    names an unset reference that left the JSON unreadable."""
    option = "--kv-transfer-config"
    text = expand(option_text(text, option), {**os.environ, **pod}, unset)
    try:
        return json_object(text, option, "vLLM's KVTransferConfig")
    except ConfigError as exc:
        if not unset:
            raise
        names = ", ".join(f"$({name})" for name in sorted(unset - {"POD_IP"} or unset))
        raise ConfigError(
            f"{exc} ({names} unset here: give the pod's value with --env NAME=VALUE)"
        ) from None


def run(args: argparse.Namespace) -> int:
    """0: every entry would start; 1: the config runs no p2pkv tier (one line on stderr);
    2: the tier would refuse it (one line on stderr), or a usage error (``ConfigError``,
    which the CLI turns into one line and exit status 2)."""
    unset: set[str] = set()
    pod = _pod_environment(args, unset)
    os.environ.update(pod)
    kv_transfer_config = _expanded_config(args.kv_transfer_config, pod, unset)
    for name in sorted(unset):
        print_error(
            "p2pkv check-config: note",
            f"$({name}) is unset here: checked as "
            f"{PLACEHOLDER_ADDRESS} (set it with --env {name}=VALUE"
            f"{' or --pod-ip' if name == 'POD_IP' else ''})",
        )
    try:
        extra, found = entries(kv_transfer_config)
    except BuiltInTier as exc:
        print_error("p2pkv check-config", str(exc))
        return 1
    problem = connector_problem(kv_transfer_config, extra)
    if problem is not None:
        print_error("p2pkv check-config", problem)
        return 1
    for entry in found:
        try:
            config = check(entry, extra, args.data_parallel_size, bind=not args.no_bind)
            sockets = socket_budget(config)
        except (P2PKVError, OSError) as exc:
            print_error("p2pkv check-config", _refusal(entry, exc))
            return 2
        last = config.base_port + args.data_parallel_size - 1 if config.base_port else 0
        print(
            f"{entry.where}: ok: p2pkv's P2PKVTier ({entry.how}): control "
            f"{config.control}, data {config.data}, host "
            f"{config.host}, ports {config.base_port}..{last} (DP ranks 0.."
            f"{args.data_parallel_size - 1}){_summary(entry, config)}{sockets}"
        )
        if args.no_bind:
            print(
                f"{entry.where}: not checked here (--no-bind), only on the pod: "
                f"{'; '.join(_POD_ONLY)}"
            )
    for hint in _hints(os.environ):
        print_error("p2pkv check-config: hint", hint)
    return 0
