"""The ``zmq`` control transport as the registry sees it: name, capabilities, availability,
and ``create`` (options, address and security policy, then the sockets).

Importing this module never imports zmq: ``create`` does, and hands the sockets to a
:class:`p2pkv_zmq.hub.ZmqHub` that the transport owns and delegates to. Where to bind is
decided first (:mod:`p2pkv_zmq.listening`); options are listed in :mod:`p2pkv_zmq.options`.

Model (what callers and tests rely on):

- Addresses are ``host:port`` / ``[v6]:port``. ``local_address`` is the advertised address
  (``advertise`` option, else ``host``) with the bound port; it is the identity we present,
  so peers must dial exactly it. Wildcard hosts need ``advertise``.
- One PULL socket listens; every connection dials the peer with its own PUSH socket, whose
  messages start with its link id ``<our address>#<incarnation>``. Frames go out on our PUSH
  and come in on our PULL, so each direction is one TCP stream and frames arrive in order,
  each once. No socket of ours files peers under ids they choose (no ROUTER).
- An inbound peer is accepted on its first frame and returned once by ``poll`` with that frame
  buffered. Two peers dialing each other at once end up with one connection on each side.
- ``send`` never blocks: ``max_queued_frames`` per connection, then ``SendQueueFull``
  (back-pressure: the connection stays alive and the frame may be sent again later).
- Liveness: ZMTP heartbeats on every dialing socket (the listener only answers them and
  drops an inbound link silent past the peer's TTL); a disconnect, a refused dial, a failed
  handshake or none within ``handshake_timeout``, no connection within ``connect_timeout``,
  or the peer closing its end makes ``alive`` False on our next ``poll``, and
  ``ZmqConnection.close_reason`` says which. An unresolvable host, or an address whose dial
  failed within the last second, is dead at ``connect``. A restarted peer or a re-dialed
  connection is a fresh connection, never a continuation of the old one.
- Listener: connections that are not p2pkv peers (stray bytes, a cut handshake, no
  well-formed first message within ``handshake_timeout``) are closed.
- Threading: no threads of our own; every socket is used only by the thread calling the
  transport (one at a time, as the contracts require). libzmq's I/O thread does the network
  work, so heartbeats are answered even between polls. A CURVE handshake waits for our next
  ``poll`` (the ZAP allow-list check runs there).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from p2pkv.contracts import (
    Capabilities,
    ControlConnection,
    ControlSettings,
    ControlTransport,
    SessionRoom,
)
from p2pkv.errors import TransportUnavailable

from p2pkv_zmq.socket_cap import SocketCap, socket_cap

if TYPE_CHECKING:
    from p2pkv_zmq.hub import ZmqHub

__all__ = ["DISTRIBUTION", "ZmqControlTransport"]

DISTRIBUTION = "p2pkv-zmq"
_MIN_LIBZMQ = (4, 3, 0)  # stable handshake events and heartbeats


class ZmqControlTransport(ControlTransport):
    """ZeroMQ control transport (``control: zmq``). Build it with :meth:`create`; every call
    goes to the :class:`~p2pkv_zmq.hub.ZmqHub` it owns."""

    name: ClassVar[str] = "zmq"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True, cross_host=True, auth=True, heartbeats=True
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        try:
            import zmq
        except ImportError as exc:
            return TransportUnavailable(
                cls.name, DISTRIBUTION, f"pyzmq is not importable ({type(exc).__name__}: {exc})"
            )
        if zmq.zmq_version_info() < _MIN_LIBZMQ:
            return TransportUnavailable(
                cls.name,
                DISTRIBUTION,
                f"pyzmq is linked against libzmq {zmq.zmq_version()}; 4.3 or newer is needed",
            )
        return None

    def __init__(self, hub: ZmqHub) -> None:
        self._hub = hub

    @classmethod
    def socket_cap(cls, options: Mapping[str, Any]) -> SocketCap:
        """The zmq socket cap a transport of these ``control_options`` would get, set or
        derived from this process's ``ulimit -n`` (:mod:`p2pkv_zmq.socket_cap`). For
        ``p2pkv check-config``, which finds it on the registered class (no import);
        ``ConfigError`` for invalid options. Needs no zmq."""
        from p2pkv_zmq.options import read_options

        return socket_cap(read_options(options).max_sockets)

    @classmethod
    def create(cls, settings: ControlSettings) -> ZmqControlTransport:
        problem = cls.availability()
        if problem is not None:
            raise problem
        import zmq

        from p2pkv_zmq.hub import ZmqHub
        from p2pkv_zmq.listening import plan_listener
        from p2pkv_zmq.options import read_options
        from p2pkv_zmq.security import curve_keys

        options = read_options(
            {"handshake_timeout": settings.handshake_timeout, **settings.options}
        )
        plan = plan_listener(settings, options)
        keys = curve_keys(plan.bind_host, options, curve_supported=bool(zmq.has("curve")))
        return cls(ZmqHub.open(plan, options, keys, settings.max_frame_bytes))

    @property
    def local_address(self) -> str:
        return self._hub.local_address

    @property
    def silence_timeout(self) -> float:
        """See :attr:`p2pkv_zmq.hub.ZmqHub.silence_timeout`."""
        return self._hub.silence_timeout

    def connect(self, address: str) -> ControlConnection:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.connect`."""
        return self._hub.connect(address)

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.poll`."""
        return self._hub.poll(timeout)

    def take_active(self) -> Collection[ControlConnection] | None:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.take_active`."""
        return self._hub.take_active()

    def batch_sends(self) -> bool:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.batch_sends`."""
        return self._hub.batch_sends()

    def flush(self) -> None:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.flush`."""
        self._hub.flush()

    def interrupt(self) -> None:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.interrupt` (any thread)."""
        self._hub.interrupt()

    def forget_dial_failure(self, address: str) -> None:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.forget_dial_failure`."""
        self._hub.forget_dial_failure(address)

    def close(self) -> None:
        self._hub.close()

    def stats(self) -> dict[str, int]:
        """Counters: refused handshakes, dropped messages, accepted connections, live ones."""
        return self._hub.stats()

    def session_room(self) -> SessionRoom:
        """See :meth:`p2pkv_zmq.hub.ZmqHub.session_room`."""
        return self._hub.session_room()

    @property
    def accepts_refused(self) -> int:
        """Peers' connections refused while out of sockets (``refused_accepts``)."""
        return self._hub.counters["refused_accepts"]
