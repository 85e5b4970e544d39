"""Dead peers, cancel and close over real NIXL: nothing hangs, nothing is freed under a transfer.

A consumer that is SIGSTOPped before we add it never progresses its UCX worker, so the
connection cannot finish wiring up and our writes to it stay in flight (``PROC``): that is how
these tests hold a transfer "mid-flight" deterministically. NIXL cannot stop a posted write
(see the transport's module docstring), so such a transfer ends only when the consumer wakes
up, or fails when it dies.
"""

from __future__ import annotations

import threading
import weakref

import pytest
from p2pkv.contracts import EMPTY_POLL, CancelMode
from p2pkv.errors import PeerRejected, TransferSubmitError
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import transport as transport_module

BLOCK = 64 * 1024


def _stalled(make_local, doomed, **options):
    """A producer with writes in flight to a paused consumer: (producer, consumer, ids)."""
    producer = make_local(num_blocks=16, block_len=BLOCK, **options)
    consumer = doomed.data_peer(type(producer.transport), 16, BLOCK, {})
    doomed.pause()
    producer.transport.add_peer("c", consumer.descriptor)
    ids = {producer.transport.write_blocks("c", [i], [i]) for i in range(4)}
    assert producer.transport.poll("c") == EMPTY_POLL, "writes to a paused peer ended"
    return producer, consumer, ids


def _warmup_ids(transport) -> set[int]:
    """Ids of the connection warm-up READs still running (drained like transfers)."""
    return {r.warmup_id for rs in transport._by_peer.values() for r in rs if r.warmup is not None}


def _order(recorder, warmups: set[int]) -> tuple[list[str], list[int]]:
    """Call names, and the ids of write handles released (warm-up READs left out)."""
    names = recorder.names()
    released = [d for n, d in recorder.calls if n == "release_xfer_handle" and d not in warmups]
    return names, released


def test_killing_the_target_mid_transfer_fails_its_transfers(make_local, doomed, wait_for) -> None:
    producer, consumer, ids = _stalled(make_local, doomed)
    t = producer.transport

    doomed.kill()
    done, failed = wait_for(t, "c", ids)  # bounded: raises if they hang

    assert failed == ids and not done
    with pytest.raises(TransferSubmitError, match="add it again"):
        t.write_blocks("c", [0], [0])
    with pytest.raises(PeerRejected, match="disconnected"):
        t.add_peer("c-again", consumer.descriptor)
    assert t.remove_peer("c") == []
    assert t.close() == []


def test_wait_cancel_keeps_running_writes_and_they_report_once(make_local, doomed) -> None:
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport
    log = PollLog(t.poll, t.cancel, "producer")
    for tid in ids:
        log.submitted(tid, "c")

    assert sorted(log.cancel(sorted(ids), CancelMode.WAIT)) == sorted(ids)  # NIXL cannot stop them
    doomed.resume()
    wait_until(lambda: log.terminal(ids), timeout=15.0, what="the kept writes to end",
               pumps=[lambda: log.poll("c")])
    assert log.done == ids
    assert t.close() == []


def test_immediate_cancel_forgets_at_once(make_local, doomed) -> None:
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport

    assert t.cancel(sorted(ids), CancelMode.IMMEDIATE) == []
    doomed.resume()
    for _ in range(20):
        assert t.poll("c") == EMPTY_POLL


def test_close_waits_for_running_writes_then_releases_in_order(
    make_local, doomed, record, when
) -> None:
    """close must poll until the writes end, then release their handles, then the peer's
    descriptor list and agent, then our list, then deregister memory."""
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport
    warmups = {id(r.warmup) for rs in t._by_peer.values() for r in rs if r.warmup is not None}
    recorder = record(t)
    closing = threading.Event()
    recorder.on_check = closing.set
    when(closing, doomed.resume)  # the consumer wakes up only once close() is polling

    assert t.close() == []

    names, released = _order(recorder, warmups)
    assert len(released) == len(ids)
    for handle in released:  # each write handle was seen DONE before it was released
        assert recorder.state[handle] == "DONE"
    last_release = max(i for i, n in enumerate(names) if n == "release_xfer_handle")
    assert last_release < names.index("release_dlist_handle")
    assert names.index("remove_remote_agent") > names.index("release_dlist_handle")
    assert names.count("release_dlist_handle") == 2  # the peer's, then ours
    assert names[-2:] == ["deregister_memory", "deregister_memory"]  # scratch, then region


def test_close_that_cannot_drain_keeps_memory_registered_and_can_retry(
    make_local, doomed, record
) -> None:
    producer, _, ids = _stalled(make_local, doomed, drain_timeout=0.2)
    t = producer.transport
    recorder = record(t)

    assert set(t.close()) == ids | _warmup_ids(t)
    names = recorder.names()
    assert "deregister_memory" not in names and "release_dlist_handle" not in names
    assert all(recorder.state.get(d) != "PROC" for n, d in recorder.calls
               if n == "release_xfer_handle"), "a running write was released"
    assert t in transport_module._LEAKED
    with pytest.raises(TransferSubmitError):
        t.write_blocks("c", [0], [0])

    doomed.resume()
    left = t.close()
    for _ in range(50):  # bounded: each close() polls up to drain_timeout
        if not left:
            break
        left = t.close()
    assert left == []
    assert recorder.names()[-1] == "deregister_memory"
    assert t not in transport_module._LEAKED


def test_remove_peer_that_cannot_drain_reports_and_keeps_it_pollable(
    make_local, doomed, record, wait_for
) -> None:
    producer, _, ids = _stalled(make_local, doomed, drain_timeout=0.2)
    t = producer.transport
    recorder = record(t)

    assert set(t.remove_peer("c")) == ids | _warmup_ids(t)
    assert "release_dlist_handle" not in recorder.names()
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        t.write_blocks("c", [0], [0])

    doomed.resume()
    done, failed = wait_for(t, "c", ids)
    assert done == ids and not failed
    wait_until(  # released once quiescent: its warm-up READ may end a little later
        lambda: "release_dlist_handle" in recorder.names(), timeout=15.0,
        what="the removed peer to be released", pumps=[t.progress],
    )
    assert recorder.names().count("release_dlist_handle") == 1
    assert "remove_remote_agent" in recorder.names()


def test_a_handle_nixl_will_not_release_keeps_the_region(make_local, host, record, wait_for):
    producer = make_local(num_blocks=16, block_len=BLOCK)
    t = producer.transport
    consumer = host.data_peer(type(t), 16, BLOCK, {})
    t.add_peer("c", consumer.descriptor)
    wait_until(lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end",
               pumps=[t.progress])
    recorder = record(t)
    recorder.refuse_release = True

    tid = t.write_blocks("c", [1], [1])
    done, _ = wait_for(t, "c", {tid})
    assert done == {tid}  # the write ended: it is reported, its handle kept aside

    assert t.close() == [tid]
    assert "deregister_memory" not in recorder.names()
    recorder.refuse_release = False
    assert t.close() == []
    assert recorder.names()[-1] == "deregister_memory"
    consumer.close()


def _warming(make_local, doomed, **options):
    """A reader whose connection warm-up READ from a paused peer is in flight:
    (transport, warm-up handle, the 8 bytes the READ fetches once the peer wakes up)."""
    reader = make_local(num_blocks=4, block_len=BLOCK, **options)
    t = reader.transport
    peer = doomed.data_peer(type(t), 4, BLOCK, {})
    peer.fill(7)
    fetched = peer.region_bytes()[:8]
    doomed.pause()  # the cold connection cannot wire up: the READ stays in flight
    t.add_peer("c", peer.descriptor)
    assert t.poll("c") == EMPTY_POLL
    [registration] = t._by_peer["c"]
    assert t._agent.check_xfer_state(registration.warmup) == "PROC"
    return t, registration.warmup, fetched


def _released_once_ended(recorder, handle) -> bool:
    """The handle was released once, after NIXL last reported it terminal (never under PROC)."""
    released = [d for n, d in recorder.calls if n == "release_xfer_handle"]
    return released.count(id(handle)) == 1 and recorder.state.get(id(handle)) in ("DONE", "ERR")


def test_close_keeps_the_scratch_registered_and_alive_under_a_running_warmup(
    make_local, doomed, record
) -> None:
    t, warmup, fetched = _warming(make_local, doomed, drain_timeout=0.2)
    recorder = record(t)

    left = t.close()
    assert len(left) == 1, f"close returned {left} with the warm-up READ still running"
    names = recorder.names()
    assert "deregister_memory" not in names, "memory deregistered under a running READ"
    assert id(warmup) not in [d for n, d in recorder.calls if n == "release_xfer_handle"]
    assert t in transport_module._LEAKED
    scratch = weakref.ref(t._scratch)

    doomed.resume()
    wait_until(lambda: not _warmup_ids(t), timeout=15.0, what="the warm-up READ to end",
               pumps=[t.progress])  # a closed transport still progresses what it kept
    assert bytes(scratch()) == fetched  # the READ landed, in memory still registered
    assert t.close() == []
    assert _released_once_ended(recorder, warmup)
    names = recorder.names()
    assert names.index("release_xfer_handle") < names.index("deregister_memory")
    assert names[-2:] == ["deregister_memory", "deregister_memory"]  # scratch, then region
    assert t not in transport_module._LEAKED
    assert scratch() is None, "the transport still holds its scratch after a clean close"


def test_remove_peer_drains_a_running_warmup_like_a_transfer(make_local, doomed, record) -> None:
    t, warmup, fetched = _warming(make_local, doomed, drain_timeout=0.2)
    recorder = record(t)

    left = t.remove_peer("c")
    assert len(left) == 1, f"remove_peer returned {left} with the warm-up READ still running"
    names = recorder.names()
    assert "release_dlist_handle" not in names and "remove_remote_agent" not in names
    assert id(warmup) not in [d for n, d in recorder.calls if n == "release_xfer_handle"]

    doomed.resume()
    wait_until(  # no poll of "c" needed: progress() alone retires it once the READ ended
        lambda: "remove_remote_agent" in recorder.names(), timeout=15.0,
        what="the removed peer to be released once its warm-up ended", pumps=[t.progress],
    )
    assert _released_once_ended(recorder, warmup)
    assert bytes(t._scratch) == fetched  # the READ really landed, in memory kept registered
    assert t.close() == []


def test_a_warmup_handle_nixl_will_not_release_keeps_the_scratch(make_local, host, record):
    producer = make_local(num_blocks=4, block_len=BLOCK, drain_timeout=0.2)
    t = producer.transport
    consumer = host.data_peer(type(t), 4, BLOCK, {})
    recorder = record(t)
    recorder.refuse_release = True
    t.add_peer("c", consumer.descriptor)
    [warmup_id] = _warmup_ids(t)
    wait_until(lambda: "release_refused" in recorder.names(), timeout=15.0,
               what="the warm-up READ to end", pumps=[t.progress])

    assert t.close() == [warmup_id]
    assert "deregister_memory" not in recorder.names()
    recorder.refuse_release = False
    assert t.close() == []
    assert recorder.names()[-1] == "deregister_memory"
    consumer.close()


def test_a_closed_transport_disconnects_its_peers(make_local) -> None:
    """A clean close destroys the NIXL agent and its UCX worker: a peer's warm-up READ that was
    waiting on it fails (disconnect) instead of staying in flight on a silent endpoint."""
    reader = make_local(num_blocks=4, block_len=BLOCK, seed=1, drain_timeout=0.2)
    gone = make_local(num_blocks=4, block_len=BLOCK, seed=2)
    t = reader.transport
    t.add_peer("g", gone.transport.descriptor())  # `gone` never progresses: no wire-up yet
    assert _warmup_ids(t)

    assert gone.transport.close() == []
    wait_until(lambda: not _warmup_ids(t), timeout=15.0,
               what="the warm-up READ to the closed peer to fail", pumps=[t.progress])
    with pytest.raises(TransferSubmitError, match="disconnected"):
        t.write_blocks("g", [0], [0])
    assert t.remove_peer("g") == []
    assert t.close() == []


def test_a_close_left_undrained_is_finished_by_a_peer_polling_on_the_same_thread(
    make_local,
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
    assert b in transport_module._LEAKED
    wait_until(lambda: b not in transport_module._LEAKED and not _warmup_ids(a), timeout=15.0,
               what="the leaked peer to drain and go", pumps=[a.progress])
    assert b.close() == []
    assert a.remove_peer("b") == []
    assert a.close() == []
