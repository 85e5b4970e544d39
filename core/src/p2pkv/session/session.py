"""One session per peer connection: handshake, dispatch, protocol errors, lifecycle.

States: ``HANDSHAKE`` -> ``READY`` -> ``CLOSED`` (docs/protocol.md has the
diagram). In ``HANDSHAKE`` only ``hello``/``hello_ack``/``bye`` may be sent or received; any
other message from the peer is a protocol error. The session is ``READY`` once the peer's
hello was accepted (its data descriptor registered, our ack sent) **and** our hello was acked.

A session never closes itself in the middle of a call: a fatal condition (protocol error,
rejected hello, failed send, handshake timeout, peer's bye) *dooms* it, and the tier closes
doomed sessions at safe points of its tick. Closing fails every job of the session with one
outcome and cancels its reads into our region (final: nothing can land afterwards), so the
session is ``CLOSED`` at once and the tier removes its data peer. Store jobs whose blocks the
peer may still be reading keep their pins until the lease passes (docs/protocol.md §5).

Threading: driver thread only.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from p2pkv.contracts import ControlConnection
from p2pkv.errors import FrameTooLarge, ProtocolError
from p2pkv.protocol import (
    WIRE_MAJOR,
    WIRE_MINOR,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Ready,
    Release,
    RoundFailed,
    Unknown,
    decode,
    encode,
    message_type,
)
from p2pkv.session.consumer_role import LEASE_DRIFT, ConsumerRole
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv
from p2pkv.session.outbox import Outbox
from p2pkv.session.producer_role import ProducerRole
from p2pkv.types import Outcome

__all__ = ["Doom", "Session", "State"]

log = logging.getLogger(__name__)

REJECTED_PREFIX = "rejected: "
"""Head of a rejecting bye's reason (what a 2.0 peer recognises a rejection by)."""
_NO_HANDLERS: dict[type, Callable[[Any], None]] = {}
"""A closed session's handlers: it dispatches nothing (never changed)."""
_BYE_OUTCOMES = {
    Outcome.PEER_REJECTED.value: Outcome.PEER_REJECTED,
    Outcome.PROTOCOL_ERROR.value: Outcome.PROTOCOL_ERROR,
}
"""The ``bye.outcome`` values other than ``peer_dead`` (the default for anything else)."""


class State(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"


class Doom(NamedTuple):
    """Why a session must be closed: the jobs' outcome, the reason, whether to say bye, and
    whether the peer ended it (its ``bye``: it is alive, not lost)."""

    outcome: Outcome
    reason: str
    bye: str | None
    by_peer: bool = False


class Session:
    """Both roles towards one peer over one control connection."""

    def __init__(
        self, env: SessionEnv, peer: str, conn: ControlConnection, *, dialed: bool = False
    ) -> None:
        self.env = env
        self.peer = peer
        self.conn = conn
        self.dialed = dialed
        """This tier dialed it because a request named the peer: its closing in the
        handshake is logged rate-limited (requests may name thousands of dead peers); a
        session a peer opened to us logs every close with its reason."""
        self.pre_connect = False
        """Dialed on the tier's own account (a warm or probe dial, no request waits for it):
        its closing in the handshake is logged at DEBUG (the warm set reports the peer)."""
        self.last_active = env.clock()
        """When a frame last arrived or a request last named the peer (``peers.idle_timeout``)."""
        self.heard = False
        """A frame from the peer arrived: the dial made progress (it is never evicted for a
        dial that has not, and a close is not a failed dial)."""
        self.frames_in = 0
        """Frames received so far (the tier tells a visit that brought frames by it)."""
        self.state = State.HANDSHAKE
        self.acked = False
        """The peer acked our hello."""
        self.peer_hello: Hello | None = None
        self.doomed: Doom | None = None
        self.internal_errors = 0
        self.timer: Timer | None = None
        self.outbox = Outbox(conn, env.flow.max_held_frames)
        """Frames the connection's full send queue had no room for (sent as it drains)."""
        self.consumer = ConsumerRole(env, self)
        self.producer = ProducerRole(env, peer, self.send)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Fetch: self.producer.on_fetch,
            Ready: self._on_ready,
            Release: self.producer.on_release,
            RoundFailed: self.consumer.on_round_failed,
            Lookup: self.producer.on_lookup,
            LookupResp: self.consumer.on_lookup_resp,
        }
        """Handlers of the messages that need a READY session."""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, handshake_timeout: float | None = None) -> None:
        """Send our hello and arm the handshake deadline (``timeouts.handshake``, or the
        shorter ``handshake_timeout`` of a probe)."""
        env, local = self.env, self.env.local
        wait = env.timeouts.handshake if handshake_timeout is None else handshake_timeout
        self.timer = env.deadlines.at(env.clock() + wait, self._handshake_expired, wait)
        hello = env.hello
        if hello is None:  # the same for every peer: encoded once
            hello = env.hello = encode(
                Hello(
                    wire=(WIRE_MAJOR, WIRE_MINOR),
                    epoch=local.epoch,
                    address=local.address,
                    descriptor=local.descriptor,
                    num_blocks=local.num_blocks,
                    block_len=local.block_len,
                    fingerprint=local.fingerprint,
                    hash_seed=local.hash_seed,
                    lease_ms=int(env.timeouts.lease * 1000),
                )
            )
        self._send_frame(hello, "hello")

    @property
    def read_window(self) -> float:
        """How long after a fetch a read of ours is still within the producer's lease: our
        lease, or the peer's announced one if shorter, less the clock-drift allowance."""
        lease = self.env.timeouts.lease
        hello = self.peer_hello
        if hello is not None and hello.lease_ms:
            lease = min(lease, hello.lease_ms / 1000)
        return lease * (1 - LEASE_DRIFT)

    @property
    def ready(self) -> bool:
        return self.state is State.READY and self.doomed is None

    @property
    def usable(self) -> bool:
        """Still able to carry new work (handshaking or ready, not doomed, connection alive)."""
        return (
            self.state in (State.HANDSHAKE, State.READY) and self.doomed is None and self.conn.alive
        )

    @property
    def busy(self) -> bool:
        return self.state is not State.READY or self.working

    @property
    def working(self) -> bool:
        """Either role has something outstanding (a round, a pin, a lookup, a probe)."""
        return self.producer.busy or self.consumer.busy

    @property
    def idle(self) -> bool:
        """Nothing of either role open: no request, round, lookup or pin."""
        return not (self.busy or self.consumer.reqs or self.producer.reqs)

    def wind_down(self) -> None:
        """The tier is shutting down: our loads fail now (reads cancelled), the peer's rounds
        fail; the tier closes the session once ``wound_down`` (§10)."""
        self.consumer.wind_down()
        self.producer.wind_down()

    @property
    def wound_down(self) -> bool:
        """No load round or fetch round of this session is open, no block pinned for it."""
        return not (self.consumer.n_rounds or self.producer.n_rounds or self.producer.n_pins)

    def doom(
        self, outcome: Outcome, reason: str, bye: str | None, *, by_peer: bool = False
    ) -> None:
        """Mark the session for closing at the tier's next safe point (first reason wins)."""
        if self.doomed is None and self.state in (State.HANDSHAKE, State.READY):
            self.doomed = Doom(outcome, reason, bye, by_peer)
            self.env.doomed.append(self)

    def close(
        self, outcome: Outcome, reason: str, *, bye: str | None = None, close_conn: bool = True
    ) -> None:
        """Fail everything with ``outcome``; cancel our reads; say ``bye`` if given."""
        if self.state is State.CLOSED:
            return
        env = self.env
        env.deadlines.cancel(self.timer)
        self.timer = None
        handshaking = self.state is State.HANDSHAKE and outcome is not Outcome.SHUTDOWN
        if bye is not None and self.conn.alive:
            told = outcome if outcome.value in _BYE_OUTCOMES else Outcome.PEER_DEAD
            self._send_now(Bye(bye, told.value))
        self.state = State.CLOSED
        if close_conn:
            self.conn.close()
        # closed during the handshake: the peer never answered, or refused us (WARNING: the
        # operator must know); the line's form is the same either way (operators grep it)
        if handshaking and self.pre_connect:
            log.debug("session with %s closed: %s", self.peer, reason)
        elif handshaking and self.dialed:  # rate-limited: see ``dialed``
            env.warnings.log(
                env.clock(),
                logging.WARNING,
                "session with %s closed: %s",
                self.peer,
                reason,
                logger=log,
            )
        else:
            log.log(
                logging.WARNING if handshaking else logging.INFO,
                "session with %s closed: %s",
                self.peer,
                reason,
            )
        env.observers.session_closed(peer=self.peer, reason=reason)
        self.consumer.close(outcome, reason)
        self.producer.close(outcome, reason)
        if self.wound_down:
            self._unlink()

    def _unlink(self) -> None:
        """Closed, and no lease or round outlives the close: cut the references between
        the session and its roles. Reference counting then frees it, with no collection
        (a flood of evicted or failed dials left about 30 objects each for the
        collector). A session whose pins wait for their leases keeps its links until
        then, and is left to the collector."""
        self._handlers = _NO_HANDLERS
        self.consumer.unlink()
        self.producer.unlink()

    # -- sending ----------------------------------------------------------------------------

    def send(self, msg: Message, *, cleanup: bool = False) -> bool:
        """Send a non-handshake message; dropped when the session is not ready. False when
        the frame is over the size cap: not sent, the session goes on, and the caller fails
        the request that built it.

        ``cleanup``: a frame no peer waits on (the terminal fetch). It does not ask for the
        flush as the tier's call returns. On a control transport that batches it leaves with
        the next flushed frame, or at the tier's next tick (``poll`` flushes first), so it
        costs no wake-up of its own. Without batching it leaves at once, as any frame."""
        if self.state is State.READY and self.doomed is None:
            return self._send_now(msg, oversize_fails_session=False, cleanup=cleanup)
        return True

    def _send_now(
        self, msg: Message, *, oversize_fails_session: bool = True, cleanup: bool = False
    ) -> bool:
        """Send (or, behind a full send queue, hold) ``msg``. Only a frame over the size cap
        is refused (False); a full queue is back-pressure (the outbox), a dead connection
        dooms the session."""
        return self._send_frame(
            encode(msg), msg, oversize_fails_session=oversize_fails_session, cleanup=cleanup
        )

    def _send_frame(
        self,
        frame: bytes,
        what: Message | str,
        *,
        oversize_fails_session: bool = True,
        cleanup: bool = False,
    ) -> bool:
        """:meth:`_send_now` of an encoded frame (``what``: its message, or its type, for the
        log)."""
        env = self.env
        try:
            if len(frame) > env.limits.max_frame_bytes:
                raise FrameTooLarge(
                    f"frame of {len(frame)} bytes exceeds limits."
                    f"max_frame_bytes {env.limits.max_frame_bytes}"
                )
            if not cleanup:
                env.flush_control.pending = True  # the tier's guard flushes as its call returns
            if self.outbox.send(frame):
                env.congested.add(self)
                env.counters["frames_delayed"] += 1
        except (FrameTooLarge, ProtocolError) as exc:  # ProtocolError: older transports
            if oversize_fails_session:
                self.doom(Outcome.PEER_DEAD, f"send failed: {type(exc).__name__}: {exc}", None)
            else:
                log.warning(
                    "session %s: %s not sent: %s",
                    self.peer,
                    what if isinstance(what, str) else message_type(what),
                    exc,
                )
            return False
        except Exception as exc:  # ConnectionClosed, OutboxOverflow, ...
            self.doom(Outcome.PEER_DEAD, f"send failed: {type(exc).__name__}: {exc}", None)
        return True

    def flush(self) -> bool:
        """Send the frames held behind a full send queue; True once none is held (or the
        session cannot send any more)."""
        if self.state is State.CLOSED or self.doomed is not None:
            return True
        self.env.flush_control.pending = True
        try:
            return self.outbox.flush()
        except Exception as exc:
            self.doom(Outcome.PEER_DEAD, f"send failed: {type(exc).__name__}: {exc}", None)
            return True

    # -- receiving --------------------------------------------------------------------------

    def receive(self, frames: Sequence[bytes] | None = None) -> list[bytes] | None:
        """Handle received frames (``conn.recv()`` when not given).

        Returns the remaining frames, starting with the peer's new hello, when the peer
        restarted (a hello with another epoch): the tier closes this session and feeds them
        to a fresh one. Otherwise None.
        """
        if frames is None:
            frames = self.conn.recv()
        if frames:
            self.last_active = self.env.clock()
            self.heard = True
            self.frames_in += len(frames)
        for i, frame in enumerate(frames):
            if self.doomed is not None or self.state not in (State.HANDSHAKE, State.READY):
                return None
            try:
                msg = decode(frame, self.env.limits)
                if (
                    type(msg) is Hello
                    and self.peer_hello is not None
                    and msg.epoch != self.peer_hello.epoch
                ):
                    return list(frames[i:])
                self._dispatch(msg)
                self.internal_errors = 0
            except ProtocolError as exc:
                self.protocol_error(str(exc))
            except Exception as exc:
                self.internal_errors += 1
                cap = self.env.limits.max_consecutive_internal_errors
                log.exception(
                    "session %s: internal error %d/%d handling a frame",
                    self.peer,
                    self.internal_errors,
                    cap,
                )
                if self.internal_errors >= cap:
                    self.protocol_error(
                        f"{self.internal_errors} consecutive internal errors, last: "
                        f"{type(exc).__name__}: {exc}"
                    )
        return None

    def protocol_error(self, reason: str) -> None:
        env = self.env
        log.warning("protocol error from %s: %s; closing the session", self.peer, reason)
        env.counters["protocol_errors"] += 1
        env.observers.protocol_error(peer=self.peer, reason=reason)
        self.doom(Outcome.PROTOCOL_ERROR, f"protocol error: {reason}", f"protocol error: {reason}")

    def _dispatch(self, msg: Message | Unknown) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None and self.state is State.READY:  # the hot path
            handler(msg)
        elif isinstance(msg, Hello):
            self._on_hello(msg)
        elif isinstance(msg, HelloAck):
            self._on_hello_ack(msg)
        elif isinstance(msg, Bye):
            self._on_bye(msg)
        elif isinstance(msg, Unknown):
            hello = self.peer_hello
            if hello is None or hello.wire[1] <= WIRE_MINOR:
                raise ProtocolError(f"frame.type: unknown message type {msg.type!r}")
            log.debug("ignoring %r from %s (wire %d.%d)", msg.type, self.peer, *hello.wire)
        else:
            raise ProtocolError(f"{message_type(msg)}: received before the handshake completed")

    def _on_ready(self, msg: Ready) -> None:
        assert self.peer_hello is not None
        self.consumer.on_ready(msg, self.peer_hello.num_blocks)

    # -- handshake --------------------------------------------------------------------------

    def _on_hello(self, msg: Hello) -> None:
        if self.peer_hello is not None:
            raise ProtocolError("hello: duplicate hello from the same incarnation")
        reason = self._incompatibility(msg)
        if reason:
            self._reject(reason)
            return
        self.env.flush_control()  # our hello leaves now, not after the slow add_peer
        try:
            self.env.data.add_peer(self.peer, msg.descriptor)
        except Exception as exc:  # PeerRejected, or a transport bug: refuse either way
            self._reject(f"data transport refused the peer: {exc}")
            return
        self.env.data_peers.added(self.peer, self)
        self.peer_hello = msg
        self._send_now(HelloAck(msg.epoch))
        self._maybe_ready()

    def _incompatibility(self, msg: Hello) -> str:
        local = self.env.local
        if msg.wire[0] != WIRE_MAJOR:
            return (
                f"wire version {msg.wire[0]}.{msg.wire[1]} is incompatible with ours "
                f"{WIRE_MAJOR}.{WIRE_MINOR} (major versions differ)"
            )
        if msg.block_len != local.block_len:
            return (
                f"block_len mismatch: block_len {msg.block_len} does not match ours "
                f"({local.block_len}): a different model, KV dtype, block size or "
                f"parallel layout"
            )
        if msg.fingerprint and local.fingerprint and msg.fingerprint != local.fingerprint:
            return (
                f"config fingerprint {msg.fingerprint!r} does not match ours "
                f"({local.fingerprint!r}): a different model, KV cache dtype, block size, "
                f"KV-cache group layout or parallel layout (compare the run config each "
                f"side logged at start)"
            )
        if msg.hash_seed != local.hash_seed:
            return (
                f"block-hash seed {msg.hash_seed!r} does not match ours "
                f"({local.hash_seed!r}): every lookup would miss"
            )
        if msg.address != self.peer:
            return (
                f"hello.address {msg.address!r} is not the connection's peer address {self.peer!r}"
            )
        return ""

    def _reject(self, reason: str) -> None:
        env = self.env
        log.warning("rejecting peer %s: %s", self.peer, reason)
        env.counters["handshake_rejections"] += 1
        env.observers.handshake_rejected(peer=self.peer, reason=reason)
        self.doom(
            Outcome.PEER_REJECTED, f"rejected {self.peer}: {reason}", REJECTED_PREFIX + reason
        )

    def _on_hello_ack(self, msg: HelloAck) -> None:
        if msg.epoch != self.env.local.epoch:
            raise ProtocolError(
                f"hello_ack.epoch: {msg.epoch} does not echo our epoch {self.env.local.epoch}"
            )
        if not self.acked:
            self.acked = True
            self._maybe_ready()

    def _on_bye(self, msg: Bye) -> None:
        env = self.env
        outcome = _BYE_OUTCOMES.get(msg.outcome, Outcome.PEER_DEAD)
        if outcome is Outcome.PEER_REJECTED:
            reason = msg.reason.removeprefix(REJECTED_PREFIX)
            log.warning("peer %s rejected us: %s", self.peer, reason)
            env.counters["handshake_rejections"] += 1
            env.observers.handshake_rejected(peer=self.peer, reason=reason)
            self.doom(outcome, f"{self.peer} rejected us: {reason}", None, by_peer=True)
        else:
            self.doom(outcome, f"peer said bye: {msg.reason}", None, by_peer=True)

    def _maybe_ready(self) -> None:
        if self.state is not State.HANDSHAKE or not self.acked or self.peer_hello is None:
            return
        env = self.env
        env.deadlines.cancel(self.timer)
        self.timer = None
        self.state = State.READY
        log.debug("session with %s ready", self.peer)
        env.observers.session_opened(peer=self.peer, local=env.local.address)
        self.consumer.on_session_ready()

    def _handshake_expired(self, wait: float) -> None:
        self.timer = None
        env = self.env
        env.observers.timeout(kind="handshake", kv_request_id="", peer=self.peer)
        self.doom(
            Outcome.PEER_DEAD,
            f"handshake with {self.peer} not complete within {wait:g}s",
            "handshake timeout",
        )

    def state_sizes(self) -> dict[str, int]:
        return {**self.consumer.state_sizes(), **self.producer.state_sizes()}
