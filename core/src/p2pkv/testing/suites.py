"""Conformance suites: pytest test classes a transport author subclasses.

Ten lines prove a data transport (see ``docs/plugin-authors.md``)::

    from p2pkv.testing.suites import DataTransportSuite
    from my_transport import MyDataTransport

    class TestMyDataTransport(DataTransportSuite):
        transport = MyDataTransport
        options = {"progress_thread": False}   # data_options used for every instance

The kit builds every instance itself through ``transport.create(settings)``: the transport
under test here, and its peers either in this process (``same-process``) or in a spawned child
(``child-process``, a :class:`p2pkv.testing.peers.PeerHost`), so cross-process behaviour
(including a peer that is SIGKILLed or SIGSTOPped) is tested with no extra code. Tests read the
class's declared :class:`~p2pkv.contracts.Capabilities` and skip, with the reason, what it does
not claim; a transport whose ``availability()`` reports a missing library is skipped as a
whole.

Knobs (class attributes; ``transport_class`` and ``transport_options`` are also fixtures,
which a subclass may override instead):

``transport``            the class under test (or override the ``transport_class`` fixture)
``transport_name``       instead of ``transport``: an installed transport, by registry name
``options``              ``control_options``/``data_options`` for every instance
``timeout``              seconds any single expected event may take (default 10)
``same_process_pairs``   False if two instances cannot share a process
``num_blocks``/``block_len``  the region shape (data)
``max_frame_bytes``      the frame cap used by the suite (control)
``liveness_timeout``     seconds within which a dead or closed peer must show ``alive`` False
``host``                 the host to listen on (control; default ``127.0.0.1``)
``late_landing_window``  seconds the late-landing tests keep both sides progressing after a
                         read was ended (cancel, remove_peer, replacing the peer, close),
                         watching a canary in its slots (data; default 0.5)

The data suites read from the peer into the transport under test (the consumer owns every
write into its region) and, while waiting on a read, always keep the peer side progressing and
polling (a two-sided peer serves reads from there; its ``poll`` must report nothing).

Individual tests may be overridden or disabled in the subclass like any pytest test
(``test_x = None`` removes one), but a transport that needs that is not conformant.
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import pytest

from p2pkv.contracts import (
    Capabilities,
    ControlConnection,
    ControlSettings,
    ControlTransport,
    DataSettings,
    DataTransport,
    TransportKind,
)
from p2pkv.errors import (
    ConfigError,
    ConnectionClosed,
    FrameTooLarge,
    PeerRejected,
    TransferSubmitError,
)
from p2pkv.testing.peers import (
    ControlPeer,
    DataPeer,
    LocalControlPeer,
    LocalDataPeer,
    PeerHost,
    pattern,
)
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import quietly, wait_until

__all__ = ["ControlTransportSuite", "DataTransportSuite", "installed_transport"]

PEER_MODES = ("same-process", "child-process")

T = TypeVar("T")


def installed_transport(kind: TransportKind, name: str, *, missing: str = "skip") -> type[Any]:
    """The installed transport ``name`` of ``kind``, through the plugin registry.

    When it is not installed (or refused by the registry), the current test is skipped
    (``missing="skip"``) or failed (``missing="fail"``) with the registry's explanation.
    """
    from p2pkv.registry import default_registry

    try:
        return default_registry().transport(kind, name)
    except ConfigError as exc:
        (pytest.skip if missing == "skip" else pytest.fail)(str(exc))
        raise  # unreachable: skip and fail raise


class _SuiteBase:
    kind: ClassVar[TransportKind]
    transport: ClassVar[type[Any] | None] = None
    transport_name: ClassVar[str | None] = None
    options: ClassVar[Mapping[str, Any]] = {}
    timeout: ClassVar[float] = 10.0
    same_process_pairs: ClassVar[bool] = True

    @pytest.fixture
    def transport_class(self) -> type[Any]:
        if self.transport is not None:
            return self.transport
        if self.transport_name is not None:
            return installed_transport(self.kind, self.transport_name)
        pytest.fail(
            f"{type(self).__name__}: set `transport = YourTransport` (or `transport_name`) on "
            f"the suite subclass, or override the `transport_class` fixture"
        )

    @pytest.fixture
    def transport_options(self) -> Mapping[str, Any]:
        return dict(self.options)

    @pytest.fixture
    def capabilities(self, transport_class: type[Any]) -> Capabilities:
        missing = transport_class.availability()
        if missing is not None:
            pytest.skip(str(missing))
        caps = transport_class.capabilities
        assert isinstance(caps, Capabilities), (
            f"{transport_class.__name__}.capabilities must be a p2pkv Capabilities"
        )
        return caps

    @pytest.fixture(scope="class")
    @classmethod
    def peer_host(cls) -> Iterator[PeerHost]:
        """One child process per suite class, hosting every child-process peer of it."""
        with PeerHost(name=f"p2pkv-peers-{cls.__name__}") as host:
            yield host

    @pytest.fixture(params=PEER_MODES)
    def peer_mode(self, request: pytest.FixtureRequest, capabilities: Capabilities) -> str:
        mode: str = request.param
        if mode == "child-process" and not capabilities.cross_process:
            pytest.skip("transport does not claim cross_process")
        if mode == "same-process" and not self.same_process_pairs:
            pytest.skip("suite declares same_process_pairs = False")
        return mode

    @staticmethod
    def _require(flag: bool, reason: str) -> None:
        if not flag:
            pytest.skip(reason)


# -- data ------------------------------------------------------------------------------------


def _keep_pumping(
    pumps: Sequence[Callable[[], object]], seconds: float, until: Callable[[], bool]
) -> bool:
    """Call ``pumps`` for ``seconds`` (bounded; no sleep) or until ``until()`` holds first.
    Returns whether it held."""
    end = time.monotonic() + seconds
    wait_until(lambda: until() or time.monotonic() > end, timeout=seconds + 60.0,
               what=f"{seconds}s of pumping", pumps=pumps)
    return until()


class _DataPair:
    """The transport under test (``local``, a peer object: usually in this process, in a child
    where a crash must not take the test run down) with its poll log, and its peers registered
    both ways (each with a poll log of its own: a peer serving our reads must never report
    anything from its ``poll``).

    Every read goes through :meth:`submit`, which records the source blocks it must bring;
    the moment any poll reports it done, our blocks must hold them (``done`` means every byte
    is in place, not one call later)."""

    def __init__(self, local: DataPeer, timeout: float, window: float = 0.5) -> None:
        self.local = local
        self.log = PollLog(local.poll, local.cancel, "transport under test", self._check_done)
        self.timeout = timeout
        self.window = window
        self.peers: dict[str, DataPeer] = {}
        self.peer_logs: dict[str, PollLog] = {}
        self.dead: set[str] = set()
        """Peers whose transport was closed or whose process was killed: never pumped again."""
        self._sources: dict[DataPeer, bytes] = {}
        self._reads: dict[int, tuple[str, list[int], list[bytes]]] = {}
        self._canaries = itertools.count(1_000_000)

    def connect(self, peer_id: str, peer: DataPeer, seed: int | None = None) -> DataPeer:
        """Register ``peer`` both ways (its region filled from ``seed`` first, if given) and
        note its region: sources never change, and a held (SIGSTOPped) peer cannot be asked."""
        if seed is not None:
            peer.fill(seed)
        self._sources[peer] = peer.region_bytes()
        self.local.add_peer(peer_id, peer.descriptor)
        peer.add_peer("local", self.local.descriptor)
        self.peers[peer_id] = peer
        self.peer_logs[peer_id] = PollLog(peer.poll, peer.cancel, f"peer {peer_id}")
        return peer

    def pumps(self) -> list[Callable[[], object]]:
        """Progress and poll every live peer (a two-sided peer serves our reads from these)."""
        out: list[Callable[[], object]] = []
        for pid, peer in self.peers.items():
            if pid not in self.dead:
                out += [peer.pump, functools.partial(self.peer_logs[pid].poll, "local")]
        return out

    def source(self, peer_id: str) -> bytes:
        """The peer's region, as first seen (sources never change; a dead peer's is kept)."""
        peer = self.peers[peer_id]
        if peer not in self._sources:
            self._sources[peer] = peer.region_bytes()
        return self._sources[peer]

    def kill(self, peer_id: str, end: Callable[[], object]) -> None:
        """Make the peer dead with ``end`` (close it, SIGKILL its process); never pumped again."""
        self.source(peer_id)
        self.dead.add(peer_id)
        end()

    def submit(self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]) -> int:
        tid = self.local.read_blocks(peer_id, local_idxs, remote_idxs)
        self.log.submitted(tid, peer_id)
        src, b = self.source(peer_id), self.local.block_len
        self._reads[tid] = (peer_id, [int(i) for i in local_idxs],
                            [_block(src, int(r), b) for r in remote_idxs])
        return tid

    def _check_done(self, tid: int) -> None:
        peer_id, local_idxs, payload = self._reads[tid]
        ours = self.local.region_bytes()
        for li, block in zip(local_idxs, payload, strict=True):
            assert _block(ours, li, self.local.block_len) == block, (
                f"poll reported read {tid} done, but our block {li} does not hold peer "
                f"{peer_id}'s block yet: done means every byte is in our blocks when poll "
                f"reports it"
            )

    def wait_terminal(self, peer_id: str | None, ids: set[int], what: str) -> None:
        wait_until(
            lambda: self.log.terminal(ids),
            timeout=self.timeout,
            what=what,
            pumps=[*self.pumps(), lambda: self.log.poll(peer_id)],
        )

    def read(self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]) -> int:
        """Read and wait until done (the poll log checks the bytes). Returns the id."""
        tid = self.submit(peer_id, local_idxs, remote_idxs)
        self.wait_terminal(peer_id, {tid}, f"read {tid} to reach a terminal state")
        assert tid in self.log.done, f"read {tid} from peer {peer_id} (running) failed"
        return tid

    def canary(self, idxs: Sequence[int]) -> bytes:
        """Overwrite our blocks ``idxs`` with fresh bytes (an engine reusing the slots)."""
        data = pattern(next(self._canaries), len(idxs) * self.local.block_len).tobytes()
        self.local.set_blocks(idxs, data)
        return data

    def watch_canary(self, idxs: Sequence[int], canary: bytes, after: str,
                     peer_ids: Sequence[str | None] = (None,)) -> None:
        """Keep both sides progressing (and our poll going) for ``window`` seconds: no byte of
        ``canary`` in our blocks ``idxs`` may change (the late-landing rule), and no ended read
        may be reported (``PollLog``)."""
        b = self.local.block_len

        def changed() -> bool:
            now = self.local.region_bytes()
            return b"".join(_block(now, i, b) for i in idxs) != canary

        polls = [functools.partial(self.log.poll, p) for p in peer_ids]
        landed = _keep_pumping([*self.pumps(), self.local.pump, *polls], self.window, changed)
        assert not landed, (
            f"bytes landed in our blocks {list(idxs)} after {after} returned: a read that was "
            f"ended must never write into our region again"
        )


def _block(region: bytes, idx: int, block_len: int) -> bytes:
    return region[idx * block_len:(idx + 1) * block_len]


class DataTransportSuite(_SuiteBase):
    """The ``DataTransport`` contract (see ``p2pkv.contracts``). Subclass and set ``transport``."""

    kind: ClassVar[TransportKind] = "data"
    num_blocks: ClassVar[int] = 16
    block_len: ClassVar[int] = 256
    late_landing_window: ClassVar[float] = 0.5
    """Seconds the late-landing tests keep both sides progressing after a read was ended."""
    poll_budget: ClassVar[int] = 1000
    """Polls of each side within which one read, alone in an idle process, must complete."""

    # -- fixtures -------------------------------------------------------------------------

    @pytest.fixture
    def make_peer(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
        request: pytest.FixtureRequest,
    ) -> Iterator[Callable[..., DataPeer]]:
        """``make_peer(mode, num_blocks=None, block_len=None, host=None)`` -> an open peer."""
        made: list[DataPeer] = []

        def make(
            mode: str,
            num_blocks: int | None = None,
            block_len: int | None = None,
            host: PeerHost | None = None,
        ) -> DataPeer:
            n = num_blocks or self.num_blocks
            b = block_len or self.block_len
            peer: DataPeer
            if mode == "same-process":
                peer = LocalDataPeer(transport_class, n, b, transport_options)
            else:
                host = host or request.getfixturevalue("peer_host")
                peer = host.data_peer(transport_class, n, b, transport_options)
            made.append(peer)
            return peer

        yield make
        for peer in made:
            quietly(peer.resume)
            quietly(peer.close)

    @pytest.fixture
    def local(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> Iterator[LocalDataPeer]:
        self._require("DRAM" in capabilities.memory_kinds, "transport does not claim DRAM")
        local = LocalDataPeer(transport_class, self.num_blocks, self.block_len, transport_options)
        local.fill(1)
        yield local
        quietly(local.close)

    @pytest.fixture
    def pair(
        self, local: LocalDataPeer, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> _DataPair:
        """The transport under test and one peer (``"remote"``), registered both ways."""
        pair = _DataPair(local, self.timeout, self.late_landing_window)
        pair.connect("remote", make_peer(peer_mode), seed=2)
        return pair

    # -- shape and descriptor -------------------------------------------------------------

    def test_shape_and_descriptor(self, local: LocalDataPeer) -> None:
        t = local.transport
        assert (t.num_blocks, t.block_len) == (self.num_blocks, self.block_len)
        first = t.descriptor()
        assert isinstance(first, bytes) and first, "descriptor() must return non-empty bytes"
        assert t.descriptor() == first, "descriptor() must be stable"
        assert t.name and t.kind == "data"

    def test_create_rejects_a_region_that_is_not_whole_blocks(
        self, transport_class: type[DataTransport], transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        region = transport_class.allocate_region(1, self.block_len + 1, transport_options)
        with pytest.raises(ConfigError):
            transport_class.create(
                DataSettings(region=region, block_len=self.block_len, options=transport_options)
            ).close()

    def test_unknown_option_is_refused_naming_it(
        self, transport_class: type[DataTransport], transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        key = "p2pkv_conformance_no_such_option"
        options = {**transport_options, key: 1}
        region = transport_class.allocate_region(
            self.num_blocks, self.block_len, transport_options
        )
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
            pumps=[remote.pump, pair.local.pump, lambda: pair.log.poll("remote"),
                   lambda: plog.poll("local")],
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
            return pair.local.region_bytes()[(n - 1) * b:] == theirs

        _keep_pumping([*pair.pumps(), pair.local.pump], pair.window, landed)
        pair.wait_terminal("remote", {tid}, "poll to report the read progress advanced")
        assert tid in pair.log.done

    def test_a_read_completes_within_a_bounded_number_of_polls(self, pair: _DataPair) -> None:
        """A bound on calls, not on time: alternating one pump and poll of the peer and one
        poll of ours, ``poll_budget`` rounds complete a read. A transport whose I/O runs on
        threads of its own fails this in CPython: a caller spinning on ``poll`` holds the GIL,
        and such a thread gets it back only every switch interval (5 ms)."""
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
            return pair.local.region_bytes()[4 * b:5 * b] == other.region_bytes()[2 * b:3 * b]

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
        ["local-too-big", "local-negative", "remote-too-big", "remote-negative",
         "lengths-differ", "one-bad-among-good", "local-duplicate", "empty"],
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
        assert after[:(n - 1) * b] == before[:(n - 1) * b], "a refused read changed our region"

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
            theirs = remote.region_bytes()[(n - 2) * b:(n - 1) * b]
            return pair.local.region_bytes()[2 * b:3 * b] == theirs

        _keep_pumping([*pair.pumps(), pair.local.pump], pair.window, landed)
        pair.log.cancel([tid])
        _keep_pumping([*pair.pumps(), lambda: pair.log.poll("remote"),
                       lambda: pair.log.poll(None)], pair.window, lambda: False)
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

    def test_peer_closed_is_survivable(self, pair: _DataPair) -> None:
        """A peer that closed: a read from it is refused or ends, and ``remove_peer`` bounds it."""
        pair.read("remote", [0], [0])
        pair.kill("remote", functools.partial(quietly, pair.peers["remote"].close))
        _survive_dead_peer(pair, "closed")

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
                pytest.fail(f"the transport under test crashed or hung after its peer was "
                            f"SIGKILLed: {exc}")


def _empty_poll(result: Any, what: str) -> None:
    assert list(result.done) == [] and list(result.failed) == [], (
        f"{what} returned {result!r}; it must return an empty result (EMPTY_POLL)"
    )


def _survive_dead_peer(pair: _DataPair, how: str) -> None:
    """Read from the dead peer (``how`` it died): refused, or ended within the timeout, failed
    or done with its bytes; then remove it and close: all bounded, nothing reported twice."""
    try:
        tid: int | None = pair.submit("remote", [1], [1])
    except TransferSubmitError:
        tid = None
    if tid is not None:
        pair.wait_terminal("remote", {tid}, f"a read from a peer that was {how} to end "
                           f"(failed, or done with its bytes): the transport must notice that "
                           f"its peer is dead")
    pair.log.undrained(pair.local.remove_peer("remote"), "remove_peer", "remote")
    pair.log.ended_peer("remote")
    with pytest.raises(TransferSubmitError):
        pair.local.read_blocks("remote", [0], [0])
    pair.log.undrained(pair.local.close(), "close")
    pair.log.ended_all()

# -- control ---------------------------------------------------------------------------------


class _ControlPair:
    """The transport under test (wrapped as a :class:`LocalControlPeer`) and one peer.

    Every ``poll`` of the transport under test goes through :meth:`poll_local`, which records
    the inbound connections it returns, so accept-once is checked whatever the test does.
    """

    def __init__(self, local: LocalControlPeer, peer: ControlPeer, timeout: float) -> None:
        self.local = local
        self.transport: ControlTransport = local.transport
        self.peer = peer
        self.timeout = timeout
        self.inbound: list[ControlConnection] = []
        self._first: dict[int, list[bytes]] = {}

    def poll_local(self, timeout: float = 0.001) -> None:
        for conn in self.transport.poll(timeout):
            assert all(conn is not seen for seen in self.inbound), (
                "poll returned the same inbound connection twice"
            )
            first = list(conn.recv())
            assert first or not conn.alive, (
                "poll returned a live inbound connection with no frame buffered"
            )
            self.inbound.append(conn)
            self._first[id(conn)] = first

    def recv(self, conn: ControlConnection) -> list[bytes]:
        """``conn.recv()``, after the frames ``poll_local`` found buffered on an inbound one."""
        return [*self._first.pop(id(conn), ()), *conn.recv()]

    def pumps(self) -> list[Callable[[], object]]:
        return [self.poll_local, self.peer.pump]

    def accept_from_peer(self, frames: Sequence[bytes]) -> tuple[int, ControlConnection]:
        """The peer dials us and sends ``frames``; returns (peer handle, our accepted conn)."""
        before = len(self.inbound)
        handle = self.peer.connect(self.transport.local_address)
        for frame in frames:
            self.peer.send(handle, frame)
        wait_until(
            lambda: len(self.inbound) > before,
            timeout=self.timeout,
            what="our poll to return the inbound connection",
            pumps=self.pumps(),
        )
        assert len(self.inbound) == before + 1, "one peer dialed once, poll returned more"
        return handle, self.inbound[-1]

    def dial_peer(self, frames: Sequence[bytes]) -> tuple[ControlConnection, int]:
        """We dial the peer and send ``frames``; returns (our conn, the peer's handle)."""
        conn = self.transport.connect(self.peer.address)
        for frame in frames:
            conn.send(frame)
        handles: list[int] = []
        wait_until(
            lambda: _gather(handles, self.peer.accepted()),
            timeout=self.timeout,
            what="the peer to accept our connection",
            pumps=self.pumps(),
        )
        assert len(handles) == 1
        return conn, handles[0]

    def receive(self, source: Callable[[], Sequence[bytes]], count: int, what: str) -> list[bytes]:
        got: list[bytes] = []
        wait_until(
            lambda: len(_gather(got, source())) >= count,
            timeout=self.timeout,
            what=what,
            pumps=self.pumps(),
        )
        return got


class ControlTransportSuite(_SuiteBase):
    """The ``ControlTransport``/``ControlConnection`` contract. Subclass and set ``transport``."""

    kind: ClassVar[TransportKind] = "control"
    max_frame_bytes: ClassVar[int] = 64 * 1024
    liveness_timeout: ClassVar[float] = 10.0
    host: ClassVar[str] = "127.0.0.1"

    @pytest.fixture
    def make_peer(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        request: pytest.FixtureRequest,
    ) -> Iterator[Callable[..., ControlPeer]]:
        """``make_peer(mode, max_frame_bytes=None, host=None)`` -> a listening peer."""
        made: list[ControlPeer] = []

        def make(
            mode: str, max_frame_bytes: int | None = None, host: PeerHost | None = None
        ) -> ControlPeer:
            cap = max_frame_bytes or self.max_frame_bytes
            peer: ControlPeer
            if mode == "same-process":
                peer = LocalControlPeer(transport_class, transport_options, cap, self.host)
            else:
                host = host or request.getfixturevalue("peer_host")
                peer = host.control_peer(transport_class, transport_options, cap, self.host)
            made.append(peer)
            return peer

        yield make
        for peer in made:
            quietly(peer.close)

    @pytest.fixture
    def local(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> Iterator[LocalControlPeer]:
        local = LocalControlPeer(
            transport_class, transport_options, self.max_frame_bytes, self.host
        )
        yield local
        quietly(local.close)

    @pytest.fixture
    def pair(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> _ControlPair:
        return _ControlPair(local, make_peer(peer_mode), self.timeout)

    def _frames(self, count: int) -> list[bytes]:
        sizes = [1, 2, 17, 1000, self.max_frame_bytes]
        return [
            bytes([i % 251]) + pattern(i, sizes[i % len(sizes)] - 1).tobytes()
            for i in range(count)
        ]

    # -- setup ----------------------------------------------------------------------------

    def test_identity_and_address(self, local: LocalControlPeer) -> None:
        t = local.transport
        assert t.name and t.kind == "control"
        assert isinstance(t.local_address, str) and t.local_address

    def test_unknown_option_is_refused_naming_it(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        key = "p2pkv_conformance_no_such_option"
        settings = ControlSettings(self.host, 0, self.max_frame_bytes,
                                   {**transport_options, key: 1})
        with pytest.raises(ConfigError, match=key):
            transport_class.create(settings).close()

    def test_address_in_use_is_refused(
        self,
        local: LocalControlPeer,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
    ) -> None:
        from p2pkv.addressing import parse_address

        try:
            _, port = parse_address(local.address)
        except ConfigError:
            pytest.skip(f"local address {local.address!r} is not host:port")
        with pytest.raises(ConfigError):
            transport_class.create(
                ControlSettings(self.host, port, self.max_frame_bytes, transport_options)
            ).close()

    # -- delivery -------------------------------------------------------------------------

    def test_frames_arrive_in_order_each_once(self, pair: _ControlPair) -> None:
        frames = self._frames(40)
        conn, handle = pair.dial_peer(frames)
        got = pair.receive(lambda: pair.peer.frames(handle), len(frames), "40 frames")
        assert got == frames, "frames must arrive intact, in order, each exactly once"
        reply = self._frames(7)[::-1]
        for frame in reply:
            pair.peer.send(handle, frame)
        back = pair.receive(lambda: pair.recv(conn), len(reply), "the peer's replies")
        assert back == reply

    def test_inbound_connection_is_returned_once_with_its_first_frames(
        self, pair: _ControlPair
    ) -> None:
        frames = self._frames(3)
        handle = pair.peer.connect(pair.transport.local_address)
        for _ in range(20):  # dialed, nothing sent yet: nothing may be announced
            for pump in pair.pumps():
                pump()
        for frame in frames:
            pair.peer.send(handle, frame)
        wait_until(lambda: pair.inbound, timeout=self.timeout,
                   what="our poll to return the inbound connection", pumps=pair.pumps())
        conn = pair.inbound[0]
        first = pair.recv(conn)
        assert first[0] == frames[0]
        rest = pair.receive(lambda: pair.recv(conn), len(frames) - len(first), "the other frames")
        assert first + rest == frames
        for _ in range(5):
            pair.poll_local()  # fails if the connection is returned again
        assert len(pair.inbound) == 1, "one peer dialed once, poll returned more connections"

    def test_accepted_connection_can_reply(self, pair: _ControlPair) -> None:
        handle, conn = pair.accept_from_peer([b"hello"])
        conn.send(b"welcome")
        assert pair.receive(lambda: pair.peer.frames(handle), 1, "our reply") == [b"welcome"]

    def test_connect_returns_the_live_connection(self, pair: _ControlPair) -> None:
        conn = pair.transport.connect(pair.peer.address)
        assert pair.transport.connect(pair.peer.address) is conn, (
            "connect to an address with a live connection must return that connection"
        )
        assert conn.peer_address == pair.peer.address
        assert conn.alive

    def test_connections_do_not_cross_talk(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> None:
        peers = [make_peer(peer_mode) for _ in range(3)]
        pairs = [_ControlPair(local, p, self.timeout) for p in peers]
        conns = [p.dial_peer([f"to-{i}".encode()]) for i, p in enumerate(pairs)]
        for i, (p, (_, handle)) in enumerate(zip(pairs, conns, strict=True)):
            got = p.receive(functools.partial(p.peer.frames, handle), 1, f"peer {i}'s frame")
            assert got == [f"to-{i}".encode()]

    def test_frame_size_cap(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"x"])
        with pytest.raises(FrameTooLarge):
            conn.send(b"x" * (self.max_frame_bytes + 1))
        exact = b"y" * self.max_frame_bytes
        conn.send(exact)
        got = pair.receive(lambda: pair.peer.frames(handle), 2, "a frame at the cap")
        assert got == [b"x", exact]

    def test_oversized_inbound_frame_is_never_delivered(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> None:
        big_peer = make_peer(peer_mode, max_frame_bytes=self.max_frame_bytes * 4)
        pair = _ControlPair(local, big_peer, self.timeout)
        _, conn = pair.accept_from_peer([b"hi"])
        handle = pair.peer.connect(pair.transport.local_address)
        big = b"z" * (self.max_frame_bytes * 2)
        pair.peer.send(handle, big)
        pair.peer.send(handle, b"after")
        got: list[bytes] = []
        wait_until(
            lambda: b"after" in _gather(got, pair.recv(conn)) or not conn.alive,
            timeout=self.timeout,
            what="the frame after an oversized one, or the connection's death",
            pumps=pair.pumps(),
        )
        assert big not in got, "a frame above max_frame_bytes was delivered"

    # -- close and liveness ---------------------------------------------------------------

    def test_close_is_idempotent(self, pair: _ControlPair) -> None:
        conn, _ = pair.dial_peer([b"x"])
        conn.close()
        conn.close()
        assert not conn.alive
        with pytest.raises(ConnectionClosed):
            conn.send(b"after close")
        pair.transport.close()
        pair.transport.close()

    def test_close_is_visible_to_the_peer(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"x"])
        conn.close()
        wait_until(lambda: not pair.peer.alive(handle), timeout=self.liveness_timeout,
                   what="the peer to see our closed connection die", pumps=pair.pumps())

    def test_peer_close_is_visible_to_us(self, pair: _ControlPair) -> None:
        handle, conn = pair.accept_from_peer([b"x"])
        pair.peer.close_conn(handle)
        wait_until(lambda: not conn.alive, timeout=self.liveness_timeout,
                   what="our accepted connection to die after the peer closed it",
                   pumps=pair.pumps())
        with pytest.raises(ConnectionClosed):
            conn.send(b"to the dead")

    def test_transport_close_is_visible_to_the_peer(self, pair: _ControlPair) -> None:
        _, handle = pair.dial_peer([b"x"])
        pair.transport.close()
        wait_until(lambda: not pair.peer.alive(handle), timeout=self.liveness_timeout,
                   what="the peer to see our transport close", pumps=[pair.peer.pump])

    def test_dead_connection_is_replaced_on_connect(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"first"])
        pair.peer.close_conn(handle)
        wait_until(lambda: not conn.alive, timeout=self.liveness_timeout,
                   what="our connection to die after the peer closed it", pumps=pair.pumps())
        fresh = pair.transport.connect(pair.peer.address)
        assert fresh is not conn and fresh.alive, "connect must replace a dead connection"
        fresh.send(b"second")
        handles: list[int] = []
        wait_until(lambda: _gather(handles, pair.peer.accepted()),
                   timeout=self.timeout, what="the peer to accept the new connection",
                   pumps=pair.pumps())
        got = pair.receive(lambda: pair.peer.frames(handles[-1]), 1, "a frame on the new one")
        assert got == [b"second"]

    @pytest.mark.parametrize("direction", ["dialed", "accepted"])
    def test_peer_killed_is_detected(
        self,
        local: LocalControlPeer,
        make_peer: Callable[..., ControlPeer],
        capabilities: Capabilities,
        direction: str,
    ) -> None:
        self._require(capabilities.cross_process, "transport does not claim cross_process")
        with PeerHost(name="p2pkv-doomed-peer") as host:
            pair = _ControlPair(local, make_peer("child-process", host=host), self.timeout)
            if direction == "dialed":
                conn, _ = pair.dial_peer([b"x"])
            else:
                _, conn = pair.accept_from_peer([b"x"])
            host.kill()
            wait_until(lambda: not conn.alive, timeout=self.liveness_timeout,
                       what="alive to turn False after the peer was SIGKILLed",
                       pumps=[lambda: pair.poll_local(0.01)])
            with pytest.raises(ConnectionClosed):
                conn.send(b"to the dead")

    def test_silent_peer_is_detected(
        self,
        local: LocalControlPeer,
        make_peer: Callable[..., ControlPeer],
        capabilities: Capabilities,
    ) -> None:
        self._require(capabilities.cross_process, "transport does not claim cross_process")
        self._require(capabilities.heartbeats, "transport does not claim heartbeats")
        with PeerHost(name="p2pkv-frozen-peer") as host:
            pair = _ControlPair(local, make_peer("child-process", host=host), self.timeout)
            conn, _ = pair.dial_peer([b"x"])
            host.pause()
            try:
                wait_until(lambda: not conn.alive, timeout=self.liveness_timeout,
                           what="alive to turn False while the peer is SIGSTOPped",
                           pumps=[lambda: pair.poll_local(0.01)])
            finally:
                host.kill()

    def test_connect_to_nobody_does_not_block(
        self,
        local: LocalControlPeer,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
    ) -> None:
        gone = LocalControlPeer(transport_class, transport_options, self.max_frame_bytes, self.host)
        address = gone.address
        gone.close()
        conn = local.transport.connect(address)  # must return at once
        try:
            conn.send(b"queued")
        except ConnectionClosed:
            pass  # allowed if the transport already knows the address is dead
        local.transport.poll(0.0)


# -- helpers ---------------------------------------------------------------------------------


def _gather(into: list[T], more: Iterable[T]) -> list[T]:
    into.extend(more)
    return into


