"""Dead peers, cancel and close over real NIXL: nothing hangs, nothing lands after it ended,
nothing is freed under a transfer.

A producer that is SIGSTOPped before we add it never progresses its UCX worker, so the
connection cannot finish wiring up: its warm-up READ stays in flight (``PROC``) and our reads
from it are *held*, unposted, until it ends ``DONE`` (a GET queued on an endpoint still wiring
up cannot be taken back; see ``p2pkv_nixl.reads.Reads.post``). That is how these tests hold a
read "mid-flight" deterministically; ending a held read is final at once. Over the same-host
``cma`` lane (these peers' default) our own process executes a posted read as it is posted
(staged reads over ``tcp`` are tested in ``test_staging``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
from nixl_fixtures import Local, MakeLocal, MakePollLog, MakeRecorder, Recorder, WaitFor
from p2pkv.contracts import EMPTY_POLL, PollResult
from p2pkv.errors import PeerRejected, TransferSubmitError
from p2pkv.testing.peers import ChildDataPeer, PeerHost
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport

BLOCK = 64 * 1024
CANARY = 0xCC


def _stalled(
    make_local: MakeLocal, doomed: PeerHost, **options: Any
) -> tuple[Local, ChildDataPeer, set[int]]:
    """A consumer with reads in flight from a paused producer: (consumer, producer, ids)."""
    consumer = make_local(num_blocks=16, block_len=BLOCK, **options)
    producer = doomed.data_peer(NixlDataTransport, 16, BLOCK, {})
    producer.fill(8)
    doomed.pause()
    consumer.transport.add_peer("p", producer.descriptor)
    ids = {consumer.transport.read_blocks("p", [i], [i]) for i in range(4)}
    assert consumer.transport.poll("p") == EMPTY_POLL, "reads from a paused peer ended"
    return consumer, producer, ids


def _stalled_posted(
    make_local: MakeLocal, doomed_tcp: PeerHost, **options: Any
) -> tuple[Local, ChildDataPeer, set[int]]:
    """As ``_stalled``, but with reads posted: the connection to a tcp-only producer is wired
    up before it is paused, and the consumer reads it directly (``staging: never``), so its
    stopped worker, which executes our GETs over tcp, keeps them in flight (``PROC``). (Over
    ``cma`` a read posted on a wired connection is done as it is posted.)"""
    consumer = make_local(num_blocks=16, block_len=BLOCK, staging="never", **options)
    producer = doomed_tcp.data_peer(NixlDataTransport, 16, BLOCK, {})
    producer.fill(8)
    t = consumer.transport
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())
    wait_until(
        lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end", pumps=[t.progress]
    )
    doomed_tcp.pause()
    ids = {t.read_blocks("p", [i], [i]) for i in range(4)}
    assert all(read.handle is not None for read in t._reads_in_flight())
    assert t.poll("p") == EMPTY_POLL, "reads from a paused peer ended"
    return consumer, producer, ids


def _warmup_ids(transport: NixlDataTransport) -> set[int]:
    """Ids of the connection warm-up READs still running (drained like transfers)."""
    return {peer.warmup_id for peer in transport.state.peers if peer.warmup is not None}


def _drained_by_a_neighbour(transport: NixlDataTransport, make_local: MakeLocal) -> None:
    """Wait until a leaked ``transport`` is released by the progress of another open transport
    on this thread (a closed transport's own ``progress`` and ``close`` do nothing)."""
    assert transport.close() == [] and transport.leaked
    neighbour = make_local(num_blocks=1, block_len=BLOCK, seed=9).transport
    wait_until(
        lambda: not transport.leaked,
        timeout=15.0,
        what="the leaked transport to drain",
        pumps=[neighbour.progress],
    )


def _poll_for(transport: NixlDataTransport, peer_id: str, seconds: float) -> list[PollResult]:
    """Poll ``peer_id`` throughout a bounded observation window of ``seconds`` (yielding the
    CPU a millisecond between polls, so the producer runs); every non-empty result seen."""
    seen: list[PollResult] = []
    pause = threading.Event()  # never set: a bounded yield, not a wait for anything
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = transport.poll(peer_id)
        if result.done or result.failed:
            seen.append(result)
        pause.wait(0.001)
    return seen


def test_killing_the_producer_mid_read_ends_its_reads(
    make_local: MakeLocal, doomed: PeerHost, wait_for: WaitFor
) -> None:
    consumer, producer, ids = _stalled(make_local, doomed)
    t = consumer.transport

    doomed.kill()
    done, failed = wait_for(t, "p", ids)  # bounded: raises if they hang

    assert done | failed == ids and failed, "no read failed although its producer died"
    with pytest.raises(TransferSubmitError, match="add it again"):
        t.read_blocks("p", [0], [0])
    with pytest.raises(PeerRejected, match="disconnected"):
        t.add_peer("p-again", producer.descriptor)
    assert t.remove_peer("p") == []
    assert t.close() == []


def test_cancel_of_direct_reads_is_final(
    make_local: MakeLocal, doomed: PeerHost, poll_log: MakePollLog
) -> None:
    """Cancelled while the producer is stopped, then the slots refilled: when the producer
    resumes nothing lands in them and nothing is reported."""
    consumer, _, ids = _stalled(make_local, doomed)
    t = consumer.transport
    assert t.lane("p") == "direct"
    log = poll_log(t)
    for tid in ids:
        log.submitted(tid, "p")

    log.cancel(sorted(ids))  # PollLog: returns None, and the ids are never reported
    consumer.blocks[:4] = CANARY
    doomed.resume()
    wait_until(
        lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end", pumps=[t.progress]
    )  # the connection wires up: a queued GET would run now
    assert _poll_for(t, "p", 1.0) == []
    assert (consumer.blocks[:4] == CANARY).all(), "a cancelled read landed"
    tid = log.submitted(t.read_blocks("p", [5], [5]), "p")  # the peer itself is fine
    wait_until(
        lambda: log.terminal({tid}),
        timeout=15.0,
        what="a fresh read",
        pumps=[lambda: log.poll("p")],
    )
    assert log.done == {tid}
    assert t.close() == []


def test_reads_held_for_the_wire_up_are_posted_once_it_is_done(
    make_local: MakeLocal, doomed: PeerHost, wait_for: WaitFor
) -> None:
    consumer, producer, ids = _stalled(make_local, doomed)
    t = consumer.transport
    held = list(t._reads_in_flight())
    assert len(held) == len(ids) and all(read.handle is None for read in held)
    assert t.descriptors_posted == 0  # nothing queued in UCX while the endpoint wires up

    doomed.resume()
    done, failed = wait_for(t, "p", ids)

    assert done == ids and not failed
    source = np.frombuffer(producer.region_bytes(), np.uint8).reshape(-1, BLOCK)
    np.testing.assert_array_equal(consumer.blocks[:4], source[:4])
    assert t.descriptors_posted == len(ids)
    assert t.close() == []


def test_held_reads_end_without_a_nixl_call_and_close_releases_in_order(
    make_local: MakeLocal, doomed: PeerHost, record: MakeRecorder
) -> None:
    """Reads held for the wire-up end without a NIXL call (none was posted); the warm-up is
    released once it ended; then close releases the peer's descriptor list and agent, our
    list, and deregisters memory. (close never waits for a stopped peer: that is the kit's
    isolation check.)"""
    consumer, _, ids = _stalled(make_local, doomed)
    t = consumer.transport
    assert len(list(t._reads_in_flight())) == len(ids)
    [warmup] = [peer.warmup for peer in t.state.peers]
    recorder = record(t)
    t.cancel(sorted(ids))
    doomed.resume()
    wait_until(
        lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end", pumps=[t.progress]
    )

    assert t.close() == []

    names = recorder.names()
    released = [d for n, d in recorder.calls if n == "release_xfer_handle"]
    assert released == [id(warmup)]  # the held reads had no handle to release
    last_release = max(i for i, n in enumerate(names) if n == "release_xfer_handle")
    assert last_release < names.index("release_dlist_handle")
    assert names.index("remove_remote_agent") > names.index("release_dlist_handle")
    assert names.count("release_dlist_handle") == 2  # the peer's, then ours
    assert names[-2:] == ["deregister_memory", "deregister_memory"]  # scratch, then region


def test_close_that_cannot_drain_keeps_memory_registered_and_can_retry(
    make_local: MakeLocal, doomed: PeerHost, record: MakeRecorder, poll_log: MakePollLog
) -> None:
    consumer, _, ids = _stalled(make_local, doomed, drain_timeout=0.2)
    t = consumer.transport
    log = poll_log(t)
    for tid in ids:
        log.submitted(tid, "p")
    recorder = record(t)

    left = log.undrained(t.close(), "close")  # never a read id: those ended finally
    log.ended_all()
    assert left == _warmup_ids(t) and left
    names = recorder.names()
    assert "deregister_memory" not in names and "release_dlist_handle" not in names
    assert t.leaked
    with pytest.raises(TransferSubmitError):
        t.read_blocks("p", [0], [0])

    doomed.resume()
    _drained_by_a_neighbour(t, make_local)
    assert recorder.names()[-1] == "deregister_memory"


def test_remove_peer_that_cannot_drain_its_warmup_reports_it_and_ends_the_reads(
    make_local: MakeLocal, doomed: PeerHost, record: MakeRecorder, poll_log: MakePollLog
) -> None:
    consumer, _, ids = _stalled(make_local, doomed, drain_timeout=0.2)
    t = consumer.transport
    log = poll_log(t)
    for tid in ids:
        log.submitted(tid, "p")
    recorder = record(t)

    left = log.undrained(t.remove_peer("p"), "remove_peer", "p")
    log.ended_peer("p")
    assert left == _warmup_ids(t) and left
    assert "release_dlist_handle" not in recorder.names()
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        t.read_blocks("p", [0], [0])

    doomed.resume()
    wait_until(  # released once quiescent: progress alone, no poll of "p" needed
        lambda: "release_dlist_handle" in recorder.names(),
        timeout=15.0,
        what="the removed peer to be released",
        pumps=[t.progress],
    )
    assert recorder.names().count("release_dlist_handle") == 1
    assert log.poll(None) == ([], [])


def test_a_handle_nixl_will_not_release_keeps_the_region(
    make_local: MakeLocal, host: PeerHost, record: MakeRecorder, wait_for: WaitFor
) -> None:
    consumer = make_local(num_blocks=16, block_len=BLOCK)
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 16, BLOCK, {})
    t.add_peer("p", producer.descriptor)
    wait_until(
        lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end", pumps=[t.progress]
    )
    recorder = record(t)
    recorder.refuse_release = True

    tid = t.read_blocks("p", [1], [1])
    done, _ = wait_for(t, "p", {tid})
    assert done == {tid}  # the read ended: it is reported, its handle kept aside

    [zombie] = t.close()
    assert zombie != tid  # an internal id, never the read's
    assert "deregister_memory" not in recorder.names()
    recorder.refuse_release = False
    _drained_by_a_neighbour(t, make_local)
    assert recorder.names()[-1] == "deregister_memory"
    producer.close()


def _warming(
    make_local: MakeLocal, doomed: PeerHost, **options: Any
) -> tuple[NixlDataTransport, Any, bytes]:
    """A reader whose connection warm-up READ from a paused peer is in flight:
    (transport, warm-up handle, the 8 bytes the READ fetches once the peer wakes up)."""
    reader = make_local(num_blocks=4, block_len=BLOCK, **options)
    t = reader.transport
    peer = doomed.data_peer(NixlDataTransport, 4, BLOCK, {})
    peer.fill(7)
    fetched = peer.region_bytes()[:8]
    doomed.pause()  # the cold connection cannot wire up: the READ stays in flight
    t.add_peer("c", peer.descriptor)
    assert t.poll("c") == EMPTY_POLL
    [registration] = [p for p in t.state.peers if p.peer_id == "c"]
    assert t.state.agent.check_xfer_state(registration.warmup) == "PROC"
    return t, registration.warmup, fetched


def _released_once_ended(recorder: Recorder, handle: object) -> bool:
    """The handle was released once, after NIXL last reported it terminal (never under PROC)."""
    released = [d for n, d in recorder.calls if n == "release_xfer_handle"]
    return released.count(id(handle)) == 1 and recorder.state.get(id(handle)) in ("DONE", "ERR")


def test_close_keeps_the_scratch_registered_and_alive_under_a_running_warmup(
    make_local: MakeLocal, doomed: PeerHost, record: MakeRecorder
) -> None:
    t, warmup, fetched = _warming(make_local, doomed, drain_timeout=0.2)
    recorder = record(t)

    left = t.close()
    assert len(left) == 1, f"close returned {left} with the warm-up READ still running"
    names = recorder.names()
    assert "deregister_memory" not in names, "memory deregistered under a running READ"
    assert id(warmup) not in [d for n, d in recorder.calls if n == "release_xfer_handle"]
    assert t.leaked
    scratch = weakref.ref(t.state.scratch)
    seen: list[bytes] = []  # the scratch after each state check, the last one saw it end

    def check() -> None:
        region = scratch()
        assert region is not None
        seen.append(bytes(region))

    recorder.on_check = check

    doomed.resume()
    _drained_by_a_neighbour(t, make_local)  # it progresses what the closed one kept
    assert seen[-1] == fetched  # the READ landed, in memory still registered
    assert _released_once_ended(recorder, warmup)
    names = recorder.names()
    assert names.index("release_xfer_handle") < names.index("deregister_memory")
    assert names[-2:] == ["deregister_memory", "deregister_memory"]  # scratch, then region
    assert not t.leaked
    assert scratch() is None, "the transport still holds its scratch after a clean close"


def test_remove_peer_drains_a_running_warmup_like_a_transfer(
    make_local: MakeLocal, doomed: PeerHost, record: MakeRecorder
) -> None:
    t, warmup, fetched = _warming(make_local, doomed, drain_timeout=0.2)
    recorder = record(t)

    left = t.remove_peer("c")
    assert len(left) == 1, f"remove_peer returned {left} with the warm-up READ still running"
    names = recorder.names()
    assert "release_dlist_handle" not in names and "remove_remote_agent" not in names
    assert id(warmup) not in [d for n, d in recorder.calls if n == "release_xfer_handle"]

    doomed.resume()
    wait_until(  # no poll of "c" needed: progress() alone retires it once the READ ended
        lambda: "release_dlist_handle" in recorder.names(),
        timeout=15.0,
        what="the removed peer to be released once its warm-up ended",
        pumps=[t.progress],
    )
    assert _released_once_ended(recorder, warmup)
    assert bytes(t.state.scratch) == fetched  # the READ really landed, in memory kept registered
    assert t.close() == []


def test_a_warmup_handle_nixl_will_not_release_keeps_the_scratch(
    make_local: MakeLocal, host: PeerHost, record: MakeRecorder
) -> None:
    consumer = make_local(num_blocks=4, block_len=BLOCK, drain_timeout=0.2)
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 4, BLOCK, {})
    recorder = record(t)
    recorder.refuse_release = True
    t.add_peer("p", producer.descriptor)
    [warmup_id] = _warmup_ids(t)
    wait_until(
        lambda: "release_refused" in recorder.names(),
        timeout=15.0,
        what="the warm-up READ to end",
        pumps=[t.progress],
    )

    assert t.close() == [warmup_id]
    assert "deregister_memory" not in recorder.names()
    recorder.refuse_release = False
    _drained_by_a_neighbour(t, make_local)
    assert recorder.names()[-1] == "deregister_memory"
    producer.close()


def test_a_closed_transport_disconnects_its_peers(make_local: MakeLocal) -> None:
    """A clean close destroys the NIXL agent and its UCX worker: a peer's warm-up READ that was
    waiting on it fails (disconnect) instead of staying in flight on a silent endpoint."""
    reader = make_local(num_blocks=4, block_len=BLOCK, seed=1, drain_timeout=0.2)
    gone = make_local(num_blocks=4, block_len=BLOCK, seed=2)
    t = reader.transport
    t.add_peer("g", gone.transport.descriptor())  # `gone` never progresses: no wire-up yet
    assert _warmup_ids(t)

    assert gone.transport.close() == []
    wait_until(
        lambda: not _warmup_ids(t),
        timeout=15.0,
        what="the warm-up READ to the closed peer to fail",
        pumps=[t.progress],
    )
    with pytest.raises(TransferSubmitError, match="disconnected"):
        t.read_blocks("g", [0], [0])
    assert t.remove_peer("g") == []
    assert t.close() == []


def test_a_close_left_undrained_is_finished_by_a_peer_polling_on_the_same_thread(
    make_local: MakeLocal,
) -> None:
    """Two peers in one thread warm each other up; one closes while the other is silent, so
    its warm-up cannot drain and it is leaked. The survivor's progress drives it to the end:
    it is released after all, and the survivor's own warm-up to it ends too."""
    a = make_local(num_blocks=4, block_len=BLOCK, seed=1, drain_timeout=0.2).transport
    b = make_local(num_blocks=4, block_len=BLOCK, seed=2, drain_timeout=0.2).transport
    a.add_peer("b", b.descriptor())
    b.add_peer("a", a.descriptor())
    [warmup_id] = _warmup_ids(b)

    assert b.close() == [warmup_id]  # `a` did not progress: b's READ from it still runs
    assert b.leaked
    wait_until(
        lambda: not b.leaked and not _warmup_ids(a),
        timeout=15.0,
        what="the leaked peer to drain and go",
        pumps=[a.progress],
    )
    assert b.close() == []
    assert a.remove_peer("b") == []
    assert a.close() == []


def test_cancel_ignores_unknown_and_reported_ids_and_nothing_runs_after_close(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor
) -> None:
    consumer = make_local(num_blocks=4, block_len=BLOCK)
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 4, BLOCK, {})
    t.add_peer("p", producer.descriptor)
    tid = t.read_blocks("p", [0], [0])
    assert wait_for(t, "p", {tid})[0] == {tid}
    assert t.cancel([tid, 10**9, np.int64(tid)]) is None  # type: ignore[list-item]
    assert t.close() == []
    assert t.close() == []
    assert t.poll("p") == EMPTY_POLL and t.poll() == EMPTY_POLL
    assert t.cancel([tid]) is None
    with pytest.raises(TransferSubmitError, match="closed"):
        t.read_blocks("p", [0], [0])
    with pytest.raises(PeerRejected, match="closed"):
        t.add_peer("q", producer.descriptor)
    assert t.remove_peer("p") == []
    producer.close()


def test_a_direct_read_nixl_will_not_release_is_driven_then_kept_aside(
    make_local: MakeLocal,
    doomed_tcp: PeerHost,
    record: MakeRecorder,
    caplog: pytest.LogCaptureFixture,
    wait_for: WaitFor,
) -> None:
    """NIXL refusing to release a cancelled direct read (it could not cancel it): cancel drives
    our worker up to drain_timeout; a read still running then is kept aside (logged as an
    error: on a non-cma lane its bytes could land) and released once NIXL reports it ended."""
    consumer, _, ids = _stalled_posted(make_local, doomed_tcp, drain_timeout=0.2)
    t = consumer.transport
    recorder = record(t)
    recorder.refuse_release = True
    [tid, *_] = sorted(ids)

    started = time.monotonic()
    t.cancel([tid])
    assert time.monotonic() - started < 0.2 + 5.0  # bounded by drain_timeout (plus a busy CI)
    assert "check_xfer_state" in recorder.names()  # it was driven, not just dropped
    [registration] = [p for p in t.state.peers if p.peer_id == "p"]
    assert len(registration.quarantined) == 1
    assert any("still runs after" in r.getMessage() for r in caplog.records)

    recorder.refuse_release = False
    doomed_tcp.resume()
    wait_until(
        lambda: not registration.quarantined,
        timeout=15.0,
        what="the kept read to end and be released",
        pumps=[t.progress],
    )
    rest = ids - {tid}  # never cancelled: they complete and are reported
    assert wait_for(t, "p", rest) == (rest, set())
    assert t.close() == []
