"""``DataIsolationSuite``: a stopped peer never stalls or fails another (issue 46).

:class:`~p2pkv.testing.suites.DataTransportSuite` includes these checks, so every data
transport meets them; subclass ``DataIsolationSuite`` alone to run only them (for example
with options that make a transport's shared budgets small). The rules are the data
contract's "isolation" paragraph (``p2pkv.contracts.DataTransport``):

- **No budget a frozen peer can hold.** A peer frozen with transfers in flight (a
  same-process peer no longer pumped nor polled; a child peer SIGSTOPped, in a host of its
  own so the other peers keep running) must not keep other peers' transfers from completing.
  Reads are posted through the tier's read gate (:mod:`p2pkv.session.reads`), as a tier
  posts them, so a resource the transport declares (``read_capacity``, ``TransferBusy``) is
  shared by it; a resource it shares without declaring must give each peer a share itself.
- **No call waits for a frozen peer.** ``remove_peer`` and ``close`` with a frozen peer's
  transfers in flight return within the driver bound (``p2pkv.contracts.DRIVER_BOUND``); what
  they leave running is shown by ``held``.

Bounds are work, not wall time, where they can be: the healthy peer's reads must complete
within ``isolation_rounds`` rounds (one round: every live peer progresses and polls, our
transport progresses and polls each peer, the gate posts what waits). A bound on a single call
is a contract on time; it is checked with a margin (``call_margin`` times the bound) on the
fastest of three calls: a call that waits for a frozen peer is slow every time, a loaded
machine is rarely slow three times in a row.

To exercise a budget, it must be smaller than what the frozen peer's reads need here: half the
region (``num_blocks // 2`` blocks of ``block_len`` bytes) in reads of two blocks. Set such
``options`` on the suite (``tests/conformance/test_transports.py`` has examples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest

from p2pkv.contracts import DRIVER_BOUND, DataTransport
from p2pkv.testing.peers import DataPeer, LocalDataPeer, PeerHost
from p2pkv.testing.suites.data_fixtures import DataSuiteBase
from p2pkv.testing.suites.data_pair import _DataPair
from p2pkv.testing.suites.isolation_pair import IsolationPair, timed
from p2pkv.testing.waiting import quietly

_TRIES = 3
"""Calls (or transports, for ``close``) whose fastest must be within the call limit."""
_SERVE_ROUNDS = 3
"""Rounds in which our transport takes a frozen peer's requests and starts serving them."""


class DataIsolationSuite(DataSuiteBase):
    """Isolation from a frozen peer (see the module docstring). Subclass and set
    ``transport``, as for ``DataTransportSuite``."""

    isolation_rounds: ClassVar[int] = 100
    """Rounds within which a healthy peer's reads complete while another peer is frozen."""
    call_margin: ClassVar[float] = 5.0
    """``remove_peer``/``close`` with a frozen peer return within this many driver bounds."""

    @property
    def call_limit(self) -> float:
        return self.call_margin * DRIVER_BOUND

    # -- fixtures -------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def frozen_host(cls) -> Iterator[PeerHost]:
        """A child process of its own for the peers a test freezes (SIGSTOP stops its whole
        process, and the other peers must keep running)."""
        with PeerHost(name=f"p2pkv-frozen-{cls.__name__}") as host:
            yield host

    @pytest.fixture
    def freezable(
        self, make_peer: Callable[..., DataPeer], peer_mode: str, request: pytest.FixtureRequest
    ) -> Callable[[], DataPeer]:
        """``freezable()`` -> a new peer that can be frozen alone."""
        host = request.getfixturevalue("frozen_host") if peer_mode == "child-process" else None
        return lambda: make_peer(peer_mode, host=host)

    @pytest.fixture
    def trio(
        self,
        local: LocalDataPeer,
        make_peer: Callable[..., DataPeer],
        peer_mode: str,
        freezable: Callable[[], DataPeer],
    ) -> Iterator[IsolationPair]:
        """The transport under test with peers ``frozen`` (freezable alone) and ``healthy``,
        each connection wired up by a read each way."""
        pair = _DataPair(local, self.timeout, self.late_landing_window)
        pair.connect("frozen", freezable(), seed=5)
        pair.connect("healthy", make_peer(peer_mode), seed=6)
        iso = IsolationPair(pair, local.transport)
        iso.warm("frozen")
        iso.warm("healthy")
        yield iso
        iso.frozen.thaw()

    # -- no budget a frozen peer can hold -------------------------------------------------

    @pytest.mark.parametrize("freeze", ["before-serving", "mid-transfer"])
    def test_a_frozen_source_stalls_no_other_source(self, trio: IsolationPair, freeze: str) -> None:
        """We read half our region from a peer that freezes (before it served anything, or
        after one round of work: its transfers under way), then the other half from a
        healthy peer: those reads complete, byte-exact, within ``isolation_rounds``."""
        n, iso = self.num_blocks, trio
        half = n // 2
        if freeze == "before-serving":
            iso.freeze("frozen")
        for slot in range(0, half - 1, 2):
            iso.post("frozen", [slot, slot + 1], [slot, slot + 1])
        if freeze == "mid-transfer":
            iso.round()
            iso.freeze("frozen")
        healthy = [iso.post("healthy", [slot], [slot]) for slot in range(half, n)]
        rounds = iso.rounds_until(lambda: iso.ended(healthy), self.isolation_rounds)
        assert rounds is not None, (
            f"reads from a healthy peer did not complete within {self.isolation_rounds} "
            f"rounds while another peer was frozen with reads in flight (froze "
            f"{freeze}): a budget the peers share (staging, slots, windows, queues) is held "
            f"by the frozen peer; give each peer a share, or declare it (read_capacity, "
            f"TransferBusy) so the tier shares it (docs/plugin-authors.md, 'Isolation'); "
            f"gate: {iso.gate.busy or 'nothing held'}"
        )
        refused = [p.refused for p in healthy if p.refused is not None]
        assert not refused, f"a healthy peer's read was refused: {refused[0]}"
        failed = {p.rid for p in healthy if p.rid is not None} & iso.pair.log.failed
        assert not failed, f"healthy peer's reads {sorted(failed)} failed"
        iso.frozen.thaw()
        iso.cancel_pending("frozen")

    def test_a_frozen_reader_stalls_no_other_reader(self, trio: IsolationPair) -> None:
        """A peer reading half our region freezes (its requests reached us: we serve them into
        a stopped process); a healthy peer's reads of the other half are served within
        ``isolation_rounds``, and again after we removed the frozen peer."""
        n, iso = self.num_blocks, trio
        half = n // 2
        iso.serve("frozen", [([s, s + 1], [s, s + 1]) for s in range(0, half - 1, 2)])
        iso.pair.peer_logs["frozen"].poll("local")  # a child peer sent its requests by now
        iso.freeze("frozen")
        for _ in range(_SERVE_ROUNDS):
            iso.round()
        self._healthy_reader_served(iso, "while the reader was frozen")
        iso.pair.log.undrained(iso.pair.local.remove_peer("frozen"), "remove_peer")
        iso.pair.log.ended_peer("frozen")
        self._healthy_reader_served(iso, "after removing the frozen reader")

    # -- no call waits for a frozen peer --------------------------------------------------

    def test_removing_a_frozen_peer_is_bounded(
        self, local: LocalDataPeer, freezable: Callable[[], DataPeer]
    ) -> None:
        """Three peers freeze with transfers in flight both ways (they read our region, we
        read theirs); ``remove_peer`` of each returns within the call limit (the fastest of
        the three), and what a removal leaves running is shown by ``held``."""
        pair = _DataPair(local, self.timeout, self.late_landing_window)
        iso = IsolationPair(pair, local.transport)
        peer_ids = [f"frozen{i}" for i in range(_TRIES)]
        try:
            self._freeze_in_flight(iso, peer_ids, freezable)
            took = []
            for peer_id in peer_ids:
                left, seconds = timed(local.remove_peer, peer_id)
                took.append(seconds)
                pair.log.undrained(left, "remove_peer", peer_id)
                pair.log.ended_peer(peer_id)
                assert not left or local.transport.held(), (
                    f"remove_peer({peer_id!r}) returned internal transfers {left} still "
                    f"running, but held() shows nothing: what a removed peer leaves must be "
                    f"accounted for until it is released"
                )
        finally:
            iso.frozen.thaw()
        assert min(took) <= self.call_limit, (
            f"remove_peer of a frozen peer took {[round(t, 3) for t in took]}s, each over "
            f"{self.call_limit:g}s ({self.call_margin:g} x the driver bound of "
            f"{DRIVER_BOUND:g}s): it waited for the frozen peer; end a removed peer's "
            f"transfers in later progress calls (docs/plugin-authors.md, 'The driver bound')"
        )

    def test_closing_with_a_frozen_peer_is_bounded(
        self,
        local: LocalDataPeer,
        freezable: Callable[[], DataPeer],
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
    ) -> None:
        """A peer freezes with transfers in flight both ways; ``close`` returns within the
        call limit (the fastest of up to three transports, each with a frozen peer)."""
        took: list[float] = []
        for attempt in range(_TRIES):
            ours = (
                local
                if attempt == 0
                else LocalDataPeer(
                    transport_class, self.num_blocks, self.block_len, transport_options
                )
            )
            iso = IsolationPair(
                _DataPair(ours, self.timeout, self.late_landing_window), ours.transport
            )
            try:
                self._freeze_in_flight(iso, [f"frozen{attempt}"], freezable)
                took.append(timed(ours.close)[1])
            finally:
                iso.frozen.thaw()
                quietly(ours.close)
            if took[-1] <= self.call_limit:
                return
        pytest.fail(
            f"close with a frozen peer took {[round(t, 3) for t in took]}s, each over "
            f"{self.call_limit:g}s ({self.call_margin:g} x the driver bound of "
            f"{DRIVER_BOUND:g}s): it waited for the frozen peer; wait at most DRAIN_GRACE "
            f"and return what still runs (docs/plugin-authors.md, 'The driver bound')"
        )

    # -- helpers --------------------------------------------------------------------------

    def _healthy_reader_served(self, iso: IsolationPair, what: str) -> None:
        """The healthy peer reads the second half of our region: served within
        ``isolation_rounds``, every read done."""
        n = self.num_blocks
        log = iso.pair.peer_logs["healthy"]
        ids = iso.serve("healthy", [([slot], [slot]) for slot in range(n // 2, n)])
        rounds = iso.rounds_until(lambda: log.terminal(ids), self.isolation_rounds)
        assert rounds is not None, (
            f"a healthy peer's reads of our region were not served within "
            f"{self.isolation_rounds} rounds {what}: serving one peer must not wait for "
            f"another (docs/plugin-authors.md, 'Isolation')"
        )
        assert ids <= log.done, f"a healthy peer's reads of our region failed {what}"

    def _freeze_in_flight(
        self, iso: IsolationPair, peer_ids: list[str], freezable: Callable[[], DataPeer]
    ) -> None:
        """Connect ``peer_ids`` (freezable peers), have each read our first two blocks into
        its last two, freeze them, read the first two of each into our second half, and serve
        what reached us for a few rounds: each frozen peer then has transfers in flight both
        ways (blocks read from are never written)."""
        pair, n = iso.pair, self.num_blocks
        for i, peer_id in enumerate(peer_ids):
            pair.connect(peer_id, freezable(), seed=10 + i)
            iso.warm(peer_id)
            iso.serve(peer_id, [([n - 2, n - 1], [0, 1])])
            pair.peer_logs[peer_id].poll("local")  # a child peer sent its request by now
        iso.freeze(*peer_ids)
        for i, peer_id in enumerate(peer_ids):
            slot = n // 2 + (2 * i) % (n // 2 - 1)
            iso.post(peer_id, [slot, slot + 1], [0, 1])
        for _ in range(_SERVE_ROUNDS):
            iso.round()
