"""The link-pairing protocol of the ``zmq`` control transport: its rules, and its state with
no I/O (the hub does the I/O, through a :class:`LinkPort`).

Wire. Every message a PUSH sends to a peer's PULL starts with the sender's link id
``<address>#<incarnation>`` (:mod:`p2pkv_zmq.identity`). A PULL does not say which connection
a message came from; the receiver knows peer links by that id and its own connections by their
incarnation. Message shapes on the PULL:

- ``[link, frame]``: one frame of payload on the sender's connection.
- ``[link, "", "open", ref]``: the first message of a PUSH. ``ref`` is empty for a fresh dial,
  else the incarnation of the receiver's PUSH it answers.
- ``[link, "", "paired", inc]``: "I pair my PUSH ``link`` with yours of incarnation ``inc``".
  Sent on the offered PUSH itself, so it follows its open.
- ``[link, "", "gone", inc]``: "your connection whose PUSH has incarnation ``inc`` is gone".
  With ``inc`` empty: "my PUSH ``link`` is closed" (closed before it was paired).
- Anything else is malformed: dropped, counted in ``dropped_messages``, logged once per sender.

Rules (each method below applies one):

1. Accept on the first frame. A PUSH that opened fresh is remembered until its first payload
   frame. Then a connection dials back, answering that PUSH, and ``poll`` returns it with the
   frame buffered. A dial back that fails (no socket left, an address libzmq cannot dial)
   tells that PUSH "gone"; its sender ends the dial with :data:`REFUSED` as the reason.
2. Answer. An open naming one of our PUSHes completes that connection. If we retired it, the
   sender is told "gone". A second answer replaces nothing: the connection ends.
3. Both dialed at once. A fresh open while our dial to its address is unanswered is offered our
   connection ("paired" on our PUSH). Its frames are held until the peer offers too; then the
   two dials are one connection on both sides. A side that gets an offer it did not make
   accepts it and offers back. If the peer answers our dial instead, the offer lapses: the
   held frames are dropped and that PUSH is told "gone". So frames never reach a connection
   the peer does not consider the same one.
4. Old connections stay. An older connection to the same address is left alone. If the peer
   restarted or re-dialed, the old one dies by itself (disconnect or "gone"). Frames arrive
   over TCP streams not ordered with each other, so arrival order cannot tell old from new.
5. Stale links are told. Payload or an open from a PUSH whose connection ended, or one that
   never opened to us, is dropped and its sender told "gone". Stale frames never enter a
   session.
6. Incarnations authenticate. ``paired`` and ``gone`` are obeyed from any sender that names an
   incarnation of ours. The 64 random bits are sent only to the peer dialed, encrypted under
   CURVE, as they were when such messages came back on our own socket.
7. Telling is bounded. A link is told "gone" at most once per :data:`RETELL_INTERVAL`, and only
   a message that went out counts. A "gone" can be lost (queued to a peer paused past the
   heartbeat timeout), so a link that keeps sending is told again.
8. Memories are bounded. Retired ids, pending opens and told links keep the newest
   :data:`MEMORY` entries each.

Active connections. The protocol also keeps the connections with news for
``take_active``: frames delivered, or an end. Each is listed once per call, by a flag on the
connection.

Threading: the hub's driver thread only. No socket, clock or log is touched here: times come
in as ``now`` (monotonic seconds), effects go out through the port.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2pkv_zmq.connection import ZmqConnection
from p2pkv_zmq.identity import parse_link_id

__all__ = [
    "GONE",
    "MEMORY",
    "OPEN",
    "PAIRED",
    "REFUSED",
    "RETELL_INTERVAL",
    "LinkPairing",
    "LinkPort",
    "classify",
]

OPEN = b"open"
GONE = b"gone"
PAIRED = b"paired"
PAYLOAD = b""  # what classify says of [link, frame]
_VERBS = (OPEN, PAIRED, GONE)
REFUSED = (
    "closed by the peer before it answered, likely refused: it could not dial us back, "
    "out of zmq sockets (its control_options.max_sockets or ulimit -n) or unable to "
    "reach our address; its log says 'refused connections from peers'"
)
"""Why our dial ended when the peer said "gone" before any answer: mostly a refused
accept (rule 1); also an offer that lapsed (rule 3), whose other dial carries on."""
MEMORY = 4096
"""Entries kept in each bounded memory."""
MAX_HELD_FRAMES = 10_000
"""Frames held for an offered pairing before giving up on it."""
RETELL_INTERVAL = 1.0
"""Seconds before a peer link that keeps sending after it was told "gone" is told again."""
_MAX_NEWS_FACTOR = 4
"""News kept for ``take_active`` beyond this many times the live connections (or
:data:`MEMORY`) means nobody calls it: the news is dropped, and the next call says None."""


class LinkPort(Protocol):
    """The I/O the protocol asks of its hub. Called from the protocol only."""

    def dial_back(self, address: str, link: bytes) -> ZmqConnection | None:
        """A new registered connection to ``address`` answering the peer PUSH ``link``
        (rule 1), or None when it cannot be made (counted and logged by the port)."""

    def send_link(self, conn: ZmqConnection, verb: bytes, arg: bytes) -> bool:
        """``[conn.link, "", verb, arg]`` on ``conn``'s PUSH; False if it did not fit."""

    def notice(self, address: str, incarnation: bytes) -> bool:
        """Tell ``address`` that its PUSH of ``incarnation`` is gone over a PUSH dialed for
        that one message (rate-limited by the port); True if it went out."""

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn``: release its sockets and call :meth:`LinkPairing.forget`."""

    def dropped(self, link: bytes, why: str, level: int) -> None:
        """Count and log a dropped message from ``link``."""

    def warn_once(self, key: Hashable, msg: str, *args: object) -> None:
        """Log a warning once per ``key``."""


@dataclass(eq=False)
class _Opened:
    """A peer PUSH that opened to us and is not part of a connection yet."""

    address: str
    offered: ZmqConnection | None = None
    """Our unanswered dial we offered to pair it with (rule 3)."""
    frames: list[bytes] = field(default_factory=list)
    """Frames held until the peer pairs too."""


def classify(parts: list[bytes]) -> tuple[bytes, str] | str:
    """``(verb, address)`` of a message that is not payload of a paired connection (``verb``
    is :data:`PAYLOAD` for ``[link, frame]``), or why it is malformed."""
    if len(parts) == 1:  # no link id before it
        return "a message of one part (not a p2pkv zmq peer?)"
    if len(parts) == 2:
        verb = PAYLOAD
    elif len(parts) == 4 and parts[1] == b"" and parts[2] in _VERBS:
        verb = parts[2]
    else:
        return "malformed message (not a p2pkv zmq peer?)"
    parsed = parse_link_id(parts[0])
    if parsed is None:
        return "malformed link id (not a p2pkv zmq peer?)"
    return verb, parsed[0]


class LinkPairing:
    """The link tables of one hub and the rules of the module docstring.

    Our live connections are known by address (the newest is what ``connect`` returns), by
    incarnation, and, once paired, by the peer PUSH's link id (:attr:`routes`, the hot path).
    """

    def __init__(self, port: LinkPort, counters: dict[str, int]) -> None:
        self._port = port
        self._counters = counters
        self.routes: dict[bytes, ZmqConnection] = {}
        """The peer's PUSH link id -> our connection paired with it."""
        self._by_key: dict[str, list[ZmqConnection]] = {}
        """Live connections per canonical address, oldest first."""
        self._by_incarnation: dict[bytes, ZmqConnection] = {}
        self._pending: OrderedDict[bytes, _Opened] = OrderedDict()
        self._fresh: dict[str, list[bytes]] = {}
        """Address -> links of its pending fresh opens, oldest first."""
        self._offers: dict[ZmqConnection, list[bytes]] = {}
        """Our dial -> links of the pending opens offered it."""
        self._retired: OrderedDict[bytes, None] = OrderedDict()
        """Peer links and our incarnations that ended."""
        self._told: OrderedDict[bytes, float] = OrderedDict()
        """Peer links told "gone", with when."""
        self.accepted: list[ZmqConnection] = []
        """Inbound connections for the next ``poll`` to return."""
        self._news: list[ZmqConnection] | None = []
        """Connections with news since the last ``take_active``; None after an overflow."""

    # -- lookups ----------------------------------------------------------------------------

    def connection_to(self, key: str) -> ZmqConnection | None:
        """The newest live connection to the canonical address ``key``."""
        conns = self._by_key.get(key)
        return conns[-1] if conns else None

    def live(self) -> Iterator[ZmqConnection]:
        """Every live connection, oldest first (a copy: callers may retire them)."""
        return iter(list(self._by_incarnation.values()))

    def __len__(self) -> int:
        return len(self._by_incarnation)

    # -- our side ---------------------------------------------------------------------------

    def add(self, conn: ZmqConnection) -> None:
        """Register a new dial: the newest connection to its address."""
        self._by_key.setdefault(conn.key, []).append(conn)
        self._by_incarnation[conn.incarnation] = conn

    def answerable(self, key: str) -> bytes | None:
        """Take the newest fresh open of ``key`` that has sent no frame yet: a peer that
        dialed us and listens, for ``connect`` to answer (rule 1)."""
        links = self._fresh.get(key)
        if not links:
            return None
        link = links[-1]
        self._unpend(link)
        return link

    def confirm(self, conn: ZmqConnection, link: bytes, now: float) -> None:
        """The peer PUSH ``link`` carries the peer's half of ``conn``: frames held for it are
        delivered, other offers of ``conn`` lapse. A ``conn`` that died meanwhile is not
        paired: ``link`` is told "gone"."""
        if not conn.alive:
            _remember(self._retired, link)
            self.tell_gone(link, now)
            return
        conn.remote_link = link
        self.routes[link] = conn
        opened = self._unpend(link)
        if opened is not None and opened.frames:
            conn.inbox.extend(opened.frames)
            self.news(conn)
        self._withdraw_offers(conn, now)

    def forget(self, conn: ZmqConnection, now: float) -> bytes | None:
        """``conn`` ended (its ``close_reason`` is set): forget its ids, withdraw its offers,
        note the news. Returns the peer link it was paired with, if any."""
        del self._by_incarnation[conn.incarnation]
        conns = self._by_key[conn.key]
        conns.remove(conn)
        if not conns:
            del self._by_key[conn.key]
        _remember(self._retired, conn.incarnation)
        self._withdraw_offers(conn, now)
        link = conn.remote_link
        if link is not None:
            del self.routes[link]
            _remember(self._retired, link)
        self.news(conn)
        return link

    def mark_told(self, link: bytes, now: float) -> None:
        """``link`` was told "gone" (or knows): told again only after the retell interval."""
        _remember(self._told, link, now)

    # -- active connections ------------------------------------------------------------------

    def news(self, conn: ZmqConnection) -> None:
        """``conn`` got frames or ended: list it at the next ``take_active`` (once)."""
        news = self._news
        if conn.listed or news is None:
            return
        conn.listed = True
        news.append(conn)
        if len(news) > _MAX_NEWS_FACTOR * max(MEMORY, len(self._by_incarnation)):
            for listed in news:
                listed.listed = False
            self._news = None  # nobody calls take_active: keep no references

    def take_active(self) -> list[ZmqConnection] | None:
        """The connections with news since the previous call, each once; None after more
        news piled up than a caller that polls would leave (visit every connection)."""
        news = self._news
        self._news = []
        if news is None:
            return None
        for conn in news:
            conn.listed = False
        return news

    # -- inbound ----------------------------------------------------------------------------

    def on_message(self, parts: list[bytes], verb: bytes, address: str, now: float) -> None:
        """A well-formed message (see :func:`classify`) that is not payload of a paired
        connection."""
        link = parts[0]
        if verb in (PAIRED, GONE):
            self._on_notice(link, verb, parts[3], now)
        elif link in self._retired:  # its connection ended; the peer may not know yet
            # Normal at every close (frames in flight cross our close): not worth a warning.
            self._drop(
                link,
                "frames for a connection that has ended",
                now,
                notify=True,
                level=logging.DEBUG,
            )
        elif link in self.routes:
            pass  # the open of an answered PUSH came after its pairing
        elif verb == OPEN:
            self._on_open(link, address, parts[3], now)
        else:
            self._on_early_frame(link, address, parts[1], now)

    def _on_early_frame(self, link: bytes, address: str, frame: bytes, now: float) -> None:
        """Payload from a peer PUSH in no connection of ours: the first frame of a fresh PUSH
        is accepted (rule 1), an offered PUSH has its frames held (rule 3), others are told
        "gone" (rule 5)."""
        opened = self._pending.get(link)
        if opened is None:
            self._drop(
                link,
                "frames from a peer connection that never opened to this "
                "transport (a stale reconnect after a restart?)",
                now,
                notify=True,
            )
        elif opened.offered is None:
            self._unpend(link)
            self._accept(link, address, frame, now)
        elif len(opened.frames) < MAX_HELD_FRAMES:
            opened.frames.append(frame)
        else:
            self._unpend(link)
            _remember(self._retired, link)
            self._drop(
                link, "too many frames before the peer confirmed the pairing", now, notify=True
            )

    def _on_open(self, link: bytes, address: str, ref: bytes, now: float) -> None:
        if ref:
            self._on_answer(link, address, ref, now)
            return
        conn = self.connection_to(address)
        if conn is not None and conn.remote_link is None:
            self._pend(link, _Opened(address, offered=conn))  # rule 3
            self._port.send_link(conn, PAIRED, _incarnation(link))
        else:  # rule 4: a completed connection to that address stays
            self._pend(link, _Opened(address))

    def _on_answer(self, link: bytes, address: str, ref: bytes, now: float) -> None:
        """The peer PUSH ``link`` answers our PUSH of incarnation ``ref`` (rule 2)."""
        conn = self._by_incarnation.get(ref)
        if conn is None:
            self.tell_gone(link, now)  # we already retired that connection
        elif conn.remote_link is None:
            if conn.key != address:  # matched by incarnation, so still one connection
                self._port.warn_once(
                    ("alias", conn.key, address),
                    "peer dialed as %s presents itself as %s; dial the "
                    "address it advertises, or set its 'advertise' option",
                    conn.key,
                    address,
                )
            self.confirm(conn, link, now)
        else:
            self.tell_gone(link, now, via=conn)
            self._port.retire(conn, "the peer replaced its end of the connection")

    def _on_notice(self, link: bytes, verb: bytes, incarnation: bytes, now: float) -> None:
        """``paired`` or ``gone`` from the peer PUSH ``link`` (rules 3 and 6)."""
        if not incarnation:  # "gone": the sender's own PUSH closed before it was paired
            if verb != GONE:
                self._drop(link, "malformed pairing (no incarnation)", now, notify=False)
                return
            self._unpend(link)
            _remember(self._retired, link)
            self.mark_told(link, now)
            conn = self.routes.get(link)
            if conn is not None:
                self._port.retire(conn, "closed by the peer", notify=False)
            return
        conn = self._by_incarnation.get(incarnation)
        if conn is None:
            if incarnation not in self._retired:
                self._drop(
                    link,
                    "a link message for a connection this transport never had",
                    now,
                    notify=False,
                )
        elif verb == GONE:
            if conn.remote_link is not None:
                self.mark_told(conn.remote_link, now)  # it knows
                self._port.retire(conn, "closed by the peer", notify=False)
            else:
                self._port.retire(conn, REFUSED, notify=False)
        else:
            self._on_paired(conn, link, now)

    def _on_paired(self, conn: ZmqConnection, link: bytes, now: float) -> None:
        if link in self.routes:
            return  # paired with another connection of ours: the offer lapses by itself
        if conn.remote_link is None and link not in self._retired:
            offer = self._pending.get(link)
            self.confirm(conn, link, now)
            if offer is None or offer.offered is not conn:
                # We had not offered ours (its open came first on this stream): pair back.
                self._port.send_link(conn, PAIRED, _incarnation(link))
        elif conn.remote_link != link:
            self.tell_gone(link, now, via=conn)  # ours is paired otherwise: the offer lapses

    def _accept(self, link: bytes, address: str, frame: bytes, now: float) -> None:
        """The first frame of the fresh peer PUSH ``link``: a new connection dialing back,
        returned by the next ``poll`` with ``frame`` buffered, or ``link`` told "gone"."""
        conn = self._port.dial_back(address, link)
        if conn is None or not conn.alive:
            _remember(self._retired, link)
            self.tell_gone(link, now)
            return
        self.confirm(conn, link, now)
        self.accepted.append(conn)
        self._counters["accepted"] += 1
        conn.inbox.append(frame)
        self.news(conn)

    def _withdraw_offers(self, conn: ZmqConnection, now: float) -> None:
        for link in self._offers.pop(conn, ()):
            del self._pending[link]
            _remember(self._retired, link)
            self.tell_gone(link, now, via=conn)

    def _pend(self, link: bytes, opened: _Opened) -> None:
        """Remember the open of ``link`` (the oldest is forgotten beyond :data:`MEMORY`)."""
        self._unpend(link)
        self._pending[link] = opened
        if opened.offered is None:
            self._fresh.setdefault(opened.address, []).append(link)
        else:
            self._offers.setdefault(opened.offered, []).append(link)
        while len(self._pending) > MEMORY:
            self._unpend(next(iter(self._pending)))

    def _unpend(self, link: bytes) -> _Opened | None:
        """Forget the open of ``link``, if remembered, with its index entry."""
        opened = self._pending.pop(link, None)
        if opened is None:
            return None
        index: dict[Any, list[bytes]] = self._fresh
        owner: Any = opened.address
        if opened.offered is not None:
            index, owner = self._offers, opened.offered
        links = index[owner]
        links.remove(link)
        if not links:
            del index[owner]
        return opened

    # -- outbound notices --------------------------------------------------------------------

    def tell_gone(self, link: bytes, now: float, via: ZmqConnection | None = None) -> None:
        """Tell the peer PUSH ``link`` (a valid link id) that its connection is gone (rule 7):
        over ``via`` or our connection to its address, else over a notice."""
        told = self._told.get(link)
        if told is not None and now - told < RETELL_INTERVAL:
            return
        address, _, incarnation = link.rpartition(b"#")
        key = address.decode("ascii")
        conn = via if via is not None else self.connection_to(key)
        if conn is not None and conn.out is not None:
            sent = self._port.send_link(conn, GONE, incarnation)
        else:
            sent = self._port.notice(key, incarnation)
        if sent:
            self.mark_told(link, now)

    def _drop(
        self, link: bytes, why: str, now: float, *, notify: bool, level: int = logging.WARNING
    ) -> None:
        """Count and log a dropped message; ``notify``: tell ``link`` (a valid id) "gone"."""
        self._port.dropped(link, why, level)
        if notify:
            self.tell_gone(link, now)


def _incarnation(link: bytes) -> bytes:
    return link.rpartition(b"#")[2]


def _remember(memory: OrderedDict[Any, Any], key: Hashable, value: Any = None) -> None:
    """Record ``key`` (with ``value``) in a bounded memory, newest last; the oldest entry
    goes once it holds more than :data:`MEMORY`."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > MEMORY:
        memory.popitem(last=False)
