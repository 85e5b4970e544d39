"""``DataTransportSuite``: the ``DataTransport`` contract (see :mod:`p2pkv.testing.suites`)."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import pytest

from p2pkv.contracts import Capabilities, DataSettings, DataTransport
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError
from p2pkv.testing.peers import DataPeer, LocalDataPeer, PeerHost
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.suites.data_pair import _block, _DataPair, _keep_pumping
from p2pkv.testing.suites.isolation import DataIsolationSuite
from p2pkv.testing.waiting import wait_until

_NO_SWITCH = 5.0
"""Seconds of CPython's switch interval during the poll-budget test: longer than its loop
takes, so no thread is handed the GIL by time alone."""


class DataTransportSuite(DataIsolationSuite):
    """The ``DataTransport`` contract (see ``p2pkv.contracts``). Subclass and set ``transport``.

    It includes the isolation checks (:class:`~p2pkv.testing.suites.isolation.DataIsolationSuite`):
    a stopped peer never stalls or fails another."""

    # -- shape and descriptor -------------------------------------------------------------

    def test_shape_and_descriptor(self, local: LocalDataPeer) -> None:
        t = local.transport
        assert (t.num_blocks, t.block_len) == (self.num_blocks, self.block_len)
        first = t.descriptor()
        assert isinstance(first, bytes) and first, "descriptor() must return non-empty bytes"
        assert t.descriptor() == first, "descriptor() must be stable"
        assert t.name and t.kind == "data"

    def test_create_rejects_a_region_that_is_not_whole_blocks(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        region = transport_class.allocate_region(1, self.block_len + 1, transport_options)
        with pytest.raises(ConfigError):
            transport_class.create(
                DataSettings(region=region, block_len=self.block_len, options=transport_options)
            ).close()

    def test_unknown_option_is_refused_naming_it(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        key = "p2pkv_conformance_no_such_option"
        options = {**transport_options, key: 1}
        region = transport_class.allocate_region(self.num_blocks, self.block_len, transport_options)
        with pytest.raises(ConfigError, match=key):
            transport_class.create(
                DataSettings(region=region, block_len=self.block_len, options=options)
            ).close()

    # -- reads ----------------------------------------------------------------------------

    def test_reads_are_byte_exact_at_scattered_indexes(self, pair: _DataPair) -> None:
        """The peer's blocks land in exactly the named blocks of ours; nothing else of ours
        changes, and the source never changes."""
        n, b = self.num_blocks, self.block_len
        remote = pair.peers["remote"]
        ours, theirs = pair.local.region_bytes(), remote.region_bytes()
        local_idxs = [2 % n, n - 5, 3 % n, n - 1]
        remote_idxs = [5 % n, 0, (n - 3) % n, 7 % n]
        pair.read("remote", local_idxs, remote_idxs)
        after = pair.local.region_bytes()
        for blk in set(range(n)) - set(local_idxs):
            assert _block(after, blk, b) == _block(ours, blk, b), (
                f"our block {blk} was not named in the read but changed"
            )
        assert remote.region_bytes() == theirs, "a read changed the peer's (source) region"

    def test_peer_reads_from_us(self, pair: _DataPair) -> None:
        """The other direction: our ``poll``/``progress`` must serve a peer's read of our
        region (a two-sided transport serves it from there), and report nothing for it."""
        n, b = self.num_blocks, self.block_len
        remote, plog = pair.peers["remote"], pair.peer_logs["remote"]
        ours, theirs = pair.local.region_bytes(), remote.region_bytes()
        their_idxs, our_idxs = [1, n - 2], [n - 1, 0]
        tid = plog.submitted(remote.read_blocks("local", their_idxs, our_idxs), "local")
        wait_until(
            lambda: plog.terminal({tid}),
            timeout=self.timeout,
            what="the peer's read of our region",
            pumps=[
                remote.pump,
                pair.local.pump,
                lambda: pair.log.poll("remote"),
                lambda: plog.poll("local"),
            ],
        )
        assert tid in plog.done, "the peer's read of our region failed"
        after = remote.region_bytes()
        for pi, oi in zip(their_idxs, our_idxs, strict=True):
            assert _block(after, pi, b) == _block(ours, oi, b)
        for blk in set(range(n)) - set(their_idxs):
            assert _block(after, blk, b) == _block(theirs, blk, b)
        assert pair.local.region_bytes() == ours, "serving a peer's read changed our region"

    def test_each_read_reported_exactly_once(self, pair: _DataPair) -> None:
        n = self.num_blocks
        ids = {pair.submit("remote", [i % n], [(i + 3) % n]) for i in range(6)}
        assert len(ids) == 6, "transfer ids must be unique"
        pair.wait_terminal("remote", ids, "six reads to finish")
        assert ids <= pair.log.done
        for _ in range(5):  # later polls report nothing again (PollLog asserts it)
            pair.log.poll("remote")
            pair.log.poll(None)

    def test_progress_reports_and_forgets_nothing(self, pair: _DataPair) -> None:
        n = self.num_blocks
        remote = pair.peers["remote"]
        tid = pair.submit("remote", [n - 1], [0])
        b = self.block_len

        def landed() -> bool:
            theirs = remote.region_bytes()[:b]
            return pair.local.region_bytes()[(n - 1) * b :] == theirs

        _keep_pumping([*pair.pumps(), pair.local.pump], pair.window, landed)
        pair.wait_terminal("remote", {tid}, "poll to report the read progress advanced")
        assert tid in pair.log.done

    @pytest.fixture
    def gil_kept_by_the_caller(self) -> Iterator[None]:
        """CPython's switch interval raised to ``_NO_SWITCH`` for the test, set before its
        transports (and their threads) exist: a thread then gets the GIL only when the
        caller's call gives it up (a blocking call, I/O in C), never by time alone."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(max(interval, _NO_SWITCH))
        yield
        sys.setswitchinterval(interval)

    def test_a_read_completes_within_a_bounded_number_of_polls(
        self, gil_kept_by_the_caller: None, pair: _DataPair
    ) -> None:
        """A bound on calls, not on time: alternating one pump and poll of the peer and one
        poll of ours, ``poll_budget`` rounds complete a read. A transport whose I/O runs on
        Python threads of its own fails this in CPython: a caller spinning on ``poll`` holds
        the GIL, and such a thread gets it back only every switch interval (5 ms), or sooner
        on a loaded machine, where each poll takes longer. So the switch interval is raised
        for the test (``gil_kept_by_the_caller``): the outcome depends on the calls alone,
        not on the machine's load."""
        n = self.num_blocks
        remote, plog = pair.peers["remote"], pair.peer_logs["remote"]
        tid = pair.submit("remote", [n - 2], [1])
        for _ in range(self.poll_budget):
            remote.pump()
            plog.poll("local")
            pair.log.poll("remote")
            if pair.log.terminal({tid}):
                break
        assert tid in pair.log.done, (
            f"read {tid} was not done after {self.poll_budget} polls of each side (an I/O "
            f"thread starved of the GIL by the caller's polling? see docs/plugin-authors.md)"
        )

    def test_poll_is_scoped_by_peer(
        self, pair: _DataPair, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> None:
        """``poll(p)`` reports only ``p``'s reads; the others wait for their own poll."""
        other = pair.connect("other", make_peer(peer_mode), seed=3)
        t1 = pair.submit("remote", [3], [1])
        t2 = pair.submit("other", [4], [2])
        pair.wait_terminal("remote", {t1}, "the first peer's read")
        b = self.block_len

        def other_landed() -> bool:  # t2 complete: poll("remote") must still not report it
            return pair.local.region_bytes()[4 * b : 5 * b] == other.region_bytes()[2 * b : 3 * b]

        pumps = [*pair.pumps(), pair.local.pump, lambda: pair.log.poll("remote")]
        _keep_pumping(pumps, pair.window, other_landed)  # PollLog fails if t2 shows up
        assert t2 not in pair.log.done | pair.log.failed, "poll('remote') reported other's id"
        pair.wait_terminal("other", {t2}, "the second peer's read in its own poll")

    def test_poll_none_drains_every_peer(
        self, pair: _DataPair, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> None:
        pair.connect("other", make_peer(peer_mode))
        ids = {pair.submit("remote", [0], [0]), pair.submit("other", [1], [0])}
        pair.wait_terminal(None, ids, "poll(None) to report both peers' reads")

    def test_numpy_indexes_are_accepted(self, pair: _DataPair) -> None:
        import numpy as np

        n = self.num_blocks
        arrays: Any = (np.array([1, n - 2], dtype=np.int64), np.array([0, 3], dtype=np.uint32))
        pair.read("remote", *arrays)
        scalars: Any = ([np.int32(2), np.int64(4)], [np.uint16(5), 6])
        pair.read("remote", *scalars)

    # -- refusals -------------------------------------------------------------------------

    def test_read_from_unknown_peer_is_refused(self, local: LocalDataPeer) -> None:
        with pytest.raises(TransferSubmitError):
            local.transport.read_blocks("nobody", [0], [0])

    @pytest.mark.parametrize(
        "case",
        [
            "local-too-big",
            "local-negative",
            "remote-too-big",
            "remote-negative",
            "lengths-differ",
            "one-bad-among-good",
            "local-duplicate",
            "empty",
        ],
    )
    def test_bad_indexes_are_refused_before_posting(self, pair: _DataPair, case: str) -> None:
        n = self.num_blocks
        local_idxs, remote_idxs = {
            "local-too-big": ([n], [0]),
            "local-negative": ([-1], [0]),
            "remote-too-big": ([0], [n]),
            "remote-negative": ([0], [-1]),
            "lengths-differ": ([0, 1], [0]),
            "one-bad-among-good": ([0, 1, 2], [0, n, 1]),
            "local-duplicate": ([0, 1, 0], [2, 3, 4]),
            "empty": ([], []),
        }[case]
        before = pair.local.region_bytes()
        with pytest.raises(TransferSubmitError):
            pair.local.read_blocks("remote", local_idxs, remote_idxs)
        # nothing was posted: a good read afterwards is the only thing ever reported
        pair.read("remote", [n - 1], [n - 1])
        after, b = pair.local.region_bytes(), self.block_len
        assert after[: (n - 1) * b] == before[: (n - 1) * b], "a refused read changed our region"

    def test_mismatched_descriptor_is_refused(
        self, local: LocalDataPeer, make_peer: Callable[..., DataPeer], capabilities: Capabilities
    ) -> None:
        mode = "same-process" if self.same_process_pairs else "child-process"
        self._require(
            mode == "same-process" or capabilities.cross_process, "no way to build a second peer"
        )
        other = make_peer(mode, block_len=self.block_len * 2)
        with pytest.raises(PeerRejected) as info:
            local.transport.add_peer("wide", other.descriptor)
        assert str(info.value), "PeerRejected must carry the reason"
        with pytest.raises(TransferSubmitError):
            local.transport.read_blocks("wide", [0], [0])

    @pytest.mark.parametrize("garbage", [b"", b"\x00", b"\xc1" * 7, b"not a descriptor" * 4])
    def test_garbage_descriptor_is_refused(self, local: LocalDataPeer, garbage: bytes) -> None:
        with pytest.raises(PeerRejected):
            local.transport.add_peer("garbage", garbage)

    def test_truncated_descriptor_is_refused(self, local: LocalDataPeer) -> None:
        own = local.transport.descriptor()
        with pytest.raises(PeerRejected):
            local.transport.add_peer("truncated", own[: len(own) // 2])

    # -- peers ----------------------------------------------------------------------------

    def test_remove_peer_then_add_again(self, pair: _DataPair) -> None:
        pair.read("remote", [0], [0])
        left = pair.log.undrained(pair.local.remove_peer("remote"), "remove_peer", "remote")
        assert left == set(), "a quiescent peer drains to []"
        with pytest.raises(TransferSubmitError):
            pair.local.read_blocks("remote", [0], [0])
        pair.local.add_peer("remote", pair.peers["remote"].descriptor)
        pair.read("remote", [1], [1])

    def test_re_adding_the_same_descriptor_keeps_its_reads(self, pair: _DataPair) -> None:
        """``add_peer`` again with the descriptor the peer is registered with (a session
        handshake repeated) changes nothing: its reads in flight go on and are reported."""
        remote = pair.peers["remote"]
        remote.pause()
        try:
            tid = pair.submit("remote", [3], [4])
            pair.local.add_peer("remote", remote.descriptor)
        finally:
            remote.resume()
        pair.wait_terminal("remote", {tid}, "a read of a peer re-added with the same descriptor")
        assert tid in pair.log.done, "re-adding a peer with its own descriptor failed its read"

    def test_remove_unknown_peer_is_harmless(self, local: LocalDataPeer) -> None:
        assert list(local.transport.remove_peer("nobody")) == []

    # -- ending reads: cancel, remove_peer, re-add, close are final -----------------------

    def test_cancel_unknown_ids_is_ignored(self, local: LocalDataPeer) -> None:
        log = PollLog(local.poll, local.cancel, "transport under test")
        log.cancel([123456789])  # returns None (PollLog checks)
        log.poll(None)

    def test_cancel_of_a_reported_read_is_ignored(self, pair: _DataPair) -> None:
        tid = pair.read("remote", [0], [0])
        pair.log.cancel([tid])
        for _ in range(3):
            pair.log.poll(None)
        pair.read("remote", [0], [1])

    def test_cancelled_read_is_never_reported(self, pair: _DataPair) -> None:
        """Cancel once the bytes may already be in place: the id is forgotten, never reported."""
        n, b = self.num_blocks, self.block_len
        remote = pair.peers["remote"]
        tid = pair.submit("remote", [2], [n - 2])

        def landed() -> bool:
            theirs = remote.region_bytes()[(n - 2) * b : (n - 1) * b]
            return pair.local.region_bytes()[2 * b : 3 * b] == theirs

        _keep_pumping([*pair.pumps(), pair.local.pump], pair.window, landed)
        pair.log.cancel([tid])
        _keep_pumping(
            [*pair.pumps(), lambda: pair.log.poll("remote"), lambda: pair.log.poll(None)],
            pair.window,
            lambda: False,
        )
        pair.read("remote", [2], [n - 3])  # the transport still works, the slot is ours again

    @pytest.mark.parametrize("when", ["at-once", "after-progress"])
    def test_cancel_is_final(self, pair: _DataPair, when: str) -> None:
        """The late-landing rule: once ``cancel`` returned, no byte of the read may land in our
        region, whatever the peer does later. The peer is held (not pumped; a child's process
        SIGSTOPped) so the read cannot complete before the cancel where that is possible."""
        n = self.num_blocks
        slots = [1, n - 3]
        remote = pair.peers["remote"]
        remote.pause()
        try:
            tid = pair.submit("remote", slots, [4, 5])
            if when == "after-progress":
                for _ in range(20):
                    pair.local.pump()  # the read is under way, never reported by progress
            pair.log.cancel([tid])
            canary = pair.canary(slots)
        finally:
            remote.resume()
        pair.watch_canary(slots, canary, "cancel", ["remote", None])
        pair.read("remote", slots, [6, 7])  # the slots can be read into again

    def test_remove_peer_is_final(
        self, pair: _DataPair, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> None:
        """``remove_peer`` ends the peer's reads finally (no byte lands afterwards, none is
        reported, it returns no read id) and leaves other peers' reads alone; the internal ids
        it returns are never reported by ``poll`` either."""
        n = self.num_blocks
        pair.connect("other", make_peer(peer_mode), seed=3)
        remote = pair.peers["remote"]
        slots = [0, 2, n - 1]
        remote.pause()
        try:
            ids = {pair.submit("remote", [s], [s]) for s in slots}
            kept = pair.submit("other", [5], [5])
            left = pair.log.undrained(pair.local.remove_peer("remote"), "remove_peer", "remote")
            assert pair.log.ended_peer("remote") == ids
            canary = pair.canary(slots)
        finally:
            remote.resume()
        pair.watch_canary(slots, canary, "remove_peer", ["remote", "other", None])
        pair.wait_terminal("other", {kept}, "the other peer's read (remove_peer is scoped)")
        assert kept in pair.log.done, "removing one peer failed another peer's read"
        assert not left & (pair.log.done | pair.log.failed)
        pair.local.add_peer("remote", remote.descriptor)
        pair.read("remote", slots, [3, 4, 6])

    def test_replacing_a_peer_ends_its_reads(
        self, pair: _DataPair, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> None:
        """``add_peer`` with a new incarnation's descriptor (a restarted producer under the
        same id) replaces the peer: the old registration's reads end as by ``cancel``,
        finally, and later reads go to the new one."""
        old, new = pair.peers["remote"], make_peer(peer_mode)
        new.fill(4)
        new.add_peer("local", pair.local.descriptor)
        pair.peers["old remote"] = old  # still pumped: it may serve the stale read later
        pair.peer_logs["old remote"] = pair.peer_logs["remote"]
        slots = [3, 4]
        old.pause()
        try:
            pair.submit("remote", slots, [1, 2])
            pair.local.add_peer("remote", new.descriptor)
            pair.log.ended_peer("remote")
            canary = pair.canary(slots)
        finally:
            old.resume()
        pair.peers["remote"] = new
        pair.peer_logs["remote"] = PollLog(new.poll, new.cancel, "peer remote (new)")
        pair.watch_canary(slots, canary, "add_peer (replacing the peer)", ["remote", None])
        pair.read("remote", slots, [5, 6])  # checks the new incarnation's bytes landed

    # -- close ----------------------------------------------------------------------------

    def test_close_is_idempotent_and_releases_the_region(self, pair: _DataPair) -> None:
        pair.read("remote", [0], [0])
        local = pair.local
        assert isinstance(local, LocalDataPeer)
        region_ref = weakref.ref(local.region.obj)  # the allocation; views keep it alive
        assert list(local.transport.close()) == [], "a quiescent close returns []"
        assert list(local.transport.close()) == [], "a second close returns [] and is harmless"
        del local.array, local.region
        if region_ref() is None:
            return
        gc.collect()  # only garbage cycles may still hold it
        assert region_ref() is None, (
            "the transport still references the region after close() returned []"
        )

    def test_calls_after_close(self, pair: _DataPair) -> None:
        """After ``close``: ``read_blocks`` raises ``TransferSubmitError``, ``add_peer``
        ``PeerRejected``; ``poll`` returns an empty result; ``cancel``, ``remove_peer`` and
        ``progress`` do nothing (``remove_peer`` returns ``[]``); ``close`` returns ``[]``."""
        tid = pair.read("remote", [0], [0])
        t = pair.local
        assert list(t.close()) == []
        with pytest.raises(TransferSubmitError):
            t.read_blocks("remote", [1], [1])
        with pytest.raises(PeerRejected):
            t.add_peer("another", pair.peers["remote"].descriptor)
        for scope in ("remote", "another", None):
            _empty_poll(t.poll(scope), f"poll({scope!r}) after close")
        assert t.cancel([tid, tid + 1]) is None, "cancel after close returns None"
        assert list(t.remove_peer("remote")) == [], "remove_peer after close returns []"
        t.pump()  # progress: a no-op
        _empty_poll(t.poll(None), "poll after close")
        assert list(t.close()) == [], "close after close returns []"

    def test_close_is_final(self, pair: _DataPair) -> None:
        """``close`` with reads in flight is bounded, returns no read id, and no byte of those
        reads lands in the region afterwards (it is the caller's again)."""
        n = self.num_blocks
        remote = pair.peers["remote"]
        remote.pause()
        try:
            for i in range(n):
                pair.submit("remote", [i], [i])
            left = pair.log.undrained(pair.local.close(), "close")
            pair.log.ended_all()
            canary = pair.canary(list(range(n)))
        finally:
            remote.resume()

        def late_poll() -> None:
            _empty_poll(pair.local.poll(None), "poll after close")

        landed = _keep_pumping(
            [*pair.pumps(), late_poll],
            pair.window,
            lambda: pair.local.region_bytes() != canary,
        )
        assert not landed, "bytes of a read landed in the region after close() returned"
        again = set(pair.local.close())
        assert again <= left, "a second close may only repeat undrained ids"

    def test_reads_of_a_closed_peer_fail(self, pair: _DataPair) -> None:
        """The duty after a peer's ``close``: its region is its caller's again (here it is
        overwritten at once, as an engine reuses it), so no read of it may complete any more.
        A read in flight at the close ends failed, or done with the bytes it read before; a
        read posted afterwards is refused or ends failed within ``timeout``, never done; then
        ``remove_peer`` and ``close`` are bounded."""
        pair.read("remote", [0], [0])
        in_flight = pair.submit("remote", [2], [2])
        pair.close_peer("remote")
        _survive_dead_peer(pair, "closed", earlier={in_flight}, must_fail=True)

    def test_peer_killed_is_survivable(
        self,
        capabilities: Capabilities,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        make_peer: Callable[..., DataPeer],
    ) -> None:
        """SIGKILL the peer's process: we still read (or refuse), remove the peer and close.

        The transport under test runs in a child of its own here, so a crash in it fails this
        test instead of taking the test run down.
        """
        self._require(capabilities.cross_process, "transport does not claim cross_process")
        with PeerHost(name="p2pkv-survivor") as ours, PeerHost(name="p2pkv-doomed") as doomed:
            local = ours.data_peer(
                transport_class, self.num_blocks, self.block_len, transport_options
            )
            pair = _DataPair(local, self.timeout, self.late_landing_window)
            pair.connect("remote", make_peer("child-process", host=doomed))
            pair.read("remote", [0], [0])
            pair.kill("remote", doomed.kill)
            try:
                _survive_dead_peer(pair, "SIGKILLed")
            except (EOFError, TimeoutError) as exc:
                pytest.fail(
                    f"the transport under test crashed or hung after its peer was SIGKILLed: {exc}"
                )


def _empty_poll(result: Any, what: str) -> None:
    assert list(result.done) == [] and list(result.failed) == [], (
        f"{what} returned {result!r}; it must return an empty result (EMPTY_POLL)"
    )


def _survive_dead_peer(
    pair: _DataPair, how: str, earlier: Collection[int] = (), must_fail: bool = False
) -> None:
    """Read from the dead peer (``how`` it died): refused, or ended within the timeout (failed;
    done with its bytes only unless ``must_fail``), as must the reads ``earlier`` in flight
    when it died; then remove it and close: all bounded, nothing reported twice."""
    try:
        tid: int | None = pair.submit("remote", [1], [1])
    except TransferSubmitError:
        tid = None
    reads = {*earlier, *([] if tid is None else [tid])}
    pair.wait_terminal(
        "remote",
        reads,
        f"reads from a peer that was {how} to end (failed, or "
        f"done with bytes read before): the transport must notice that its "
        f"peer is dead",
    )
    assert not (must_fail and tid in pair.log.done), (
        f"read {tid}, posted after its peer was {how}, was reported done: once a peer's "
        f"close returned its region is its caller's again, and reads of it must fail"
    )
    pair.log.undrained(pair.local.remove_peer("remote"), "remove_peer", "remote")
    pair.log.ended_peer("remote")
    with pytest.raises(TransferSubmitError):
        pair.local.read_blocks("remote", [0], [0])
    pair.log.undrained(pair.local.close(), "close")
    pair.log.ended_all()
