"""Every hook a p2pkv plugin may implement, in one place.

A plugin is a module (or object) named by an entry point in the ``p2pkv`` group. It declares
``P2PKV_PLUGIN_API = 1`` and implements hooks with the :data:`hookimpl` marker::

    from p2pkv.hookspecs import hookimpl

    P2PKV_PLUGIN_API = 1


    @hookimpl
    def p2pkv_transports():
        return [MyDataTransport]

A hook implemented under a name not defined here (a misspelling) makes the registry refuse
the plugin, naming the unknown hook. Implementations must not raise from observer hooks: an
observer that raises is logged and the other observers and the core go on. Observer hooks
run on the tier's driver thread; keep them cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

__all__ = ["PLUGIN_API_VERSION", "PROJECT", "CheckResult", "DoctorCheck", "hookimpl", "hookspec"]

PROJECT = "p2pkv"
PLUGIN_API_VERSION = 1
"""Plugins declare the API they were built for as ``P2PKV_PLUGIN_API``; others are refused."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- registration ---------------------------------------------------------------------------


@hookspec
def p2pkv_transports() -> list[type[Any]]:
    """Return transport classes this plugin provides.

    Each class subclasses ``ControlTransport`` or ``DataTransport`` and carries ``name``,
    ``kind`` and ``capabilities``. Importing the plugin module must not import the
    transport's heavy library; ``availability()`` reports a missing one.
    """
    raise NotImplementedError


@hookspec
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add subcommands to the ``p2pkv`` CLI.

    Each parser must set ``func`` (``parser.set_defaults(func=...)``), a callable taking the
    parsed ``argparse.Namespace`` and returning the process exit code.
    """


@hookspec
def p2pkv_bench_baselines() -> list[type[Any]]:
    """Return raw-library baselines for ``p2pkv bench`` (optional; additive to plugin API 1).

    A baseline moves blocks with the transport's library *without* p2pkv (for example NIXL
    with the same prepared descriptors), so the bench can report p2pkv's ratio to it. Each
    class has a ``name`` (usually the transport's name, e.g. ``"nixl"``) and is duck-typed
    like a ``DataTransport`` in its direction (the consumer reads): ``create(DataSettings)``,
    ``descriptor() -> bytes``, ``add_peer(peer_id, descriptor)``, ``read_blocks(peer_id,
    local_idxs, remote_idxs) -> id`` (the peer's blocks into ours), ``progress()`` (also serves
    a peer's reads of our region where the library needs that), ``poll(peer_id) ->
    PollResult``, ``close()``, and optionally ``cancel(ids)``. A baseline without
    ``read_blocks`` is refused by the bench. It skips p2pkv's validation and bookkeeping but
    must still move real bytes (the bench verifies them). Importing the plugin module must not
    import the library.
    """
    raise NotImplementedError


@dataclass(frozen=True)
class CheckResult:
    """What a :class:`DoctorCheck` found: ``ok``, and one line of detail (for a failure: what
    is wrong and how to fix it)."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class DoctorCheck:
    """A diagnostic ``p2pkv doctor`` runs and prints beside its own checks (``name``: a few
    words; ``run``: the check, which should finish in seconds)."""

    name: str
    run: Callable[[], CheckResult]


@hookspec
def p2pkv_doctor_checks() -> list[DoctorCheck]:
    """Return checks for ``p2pkv doctor`` (optional; additive to plugin API 1).

    ``p2pkv doctor`` runs each and prints ``ok`` or ``FAILED`` with its detail, under the
    plugin's name; a failed check makes it exit 1. A check that raises (or a hook that
    raises) is reported as that check failing with the exception, never a traceback. Build
    the checks cheaply; do the work in ``run``.
    """
    raise NotImplementedError


# -- observers ------------------------------------------------------------------------------


@hookspec
def p2pkv_session_opened(peer: str, local: str) -> None:
    """A session with ``peer`` completed its handshake."""


@hookspec
def p2pkv_session_closed(peer: str, reason: str) -> None:
    """A session ended.

    ``reason``: the bye text, ``peer_dead``, ``protocol_error: ...`` or ``shutdown``.
    """


@hookspec
def p2pkv_handshake_rejected(peer: str, reason: str) -> None:
    """A peer was refused at handshake (incompatible shape, fingerprint, seed, version)."""


@hookspec
def p2pkv_protocol_error(peer: str, reason: str) -> None:
    """A peer violated the protocol; its session is being closed."""


@hookspec
def p2pkv_transfer_submitted(peer: str, transfer_id: int, blocks: int, nbytes: int) -> None:
    """A read of ours was posted: ``blocks`` blocks (``nbytes`` bytes) of ``peer``'s region
    into ours, for a load."""


@hookspec
def p2pkv_transfer_finished(
    peer: str, transfer_id: int, success: bool, nbytes: int, seconds: float
) -> None:
    """A read of ours reached a terminal state (a cancelled read never does).

    ``seconds`` counts from the moment the round's fetch was sent (the start of its lease),
    so it includes the producer's time to answer with ``ready``, not only the read itself.
    ``success`` is the data transport's verdict: a read that completed but past the lease
    still fails its load afterwards.
    """


@hookspec
def p2pkv_job_finished(
    job_id: int, is_load: bool, outcome: str, kv_request_id: str, peer: str, seconds: float
) -> None:
    """An engine job got its single result (``outcome`` is an ``Outcome`` value)."""


@hookspec
def p2pkv_timeout(kind: str, kv_request_id: str, peer: str) -> None:
    """A deadline fired (``kind``: handshake, load, lease, store, unbound_store, lookup)."""


@hookspec
def p2pkv_tier_state(in_flight_transfers: int, parked_stores: int, sessions: int) -> None:
    """Gauges, reported by an ``on_schedule_end`` when one changed since the last report,
    and by the first (``in_flight_transfers``: our reads posted and not yet terminal)."""
