"""Dead peers, cancel and close over real NIXL: nothing hangs, nothing is freed under a transfer.

A consumer that is SIGSTOPped before we add it never progresses its UCX worker, so the
connection cannot finish wiring up and our writes to it stay in flight (``PROC``): that is how
these tests hold a transfer "mid-flight" deterministically. NIXL cannot stop a posted write
(see the transport's module docstring), so such a transfer ends only when the consumer wakes
up, or fails when it dies.
"""

from __future__ import annotations

import threading

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

    assert sorted(t.close()) == sorted(ids)
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

    assert sorted(t.remove_peer("c")) == sorted(ids)
    assert "release_dlist_handle" not in recorder.names()
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        t.write_blocks("c", [0], [0])

    doomed.resume()
    done, failed = wait_for(t, "c", ids)
    assert done == ids and not failed
    assert recorder.names().count("release_dlist_handle") == 1  # released once quiescent
    assert "remove_remote_agent" in recorder.names()


def test_a_handle_nixl_will_not_release_keeps_the_region(make_local, host, record, wait_for):
    producer = make_local(num_blocks=16, block_len=BLOCK)
    t = producer.transport
    consumer = host.data_peer(type(t), 16, BLOCK, {})
    t.add_peer("c", consumer.descriptor)
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
