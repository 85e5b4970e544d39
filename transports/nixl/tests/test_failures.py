"""Dead peers, cancel and close over real NIXL: nothing hangs, nothing is freed under a transfer.

A consumer that is SIGSTOPped before we add it never progresses its UCX worker, so the
connection cannot finish wiring up and our writes to it stay in flight (``PROC``): that is how
these tests hold a transfer "mid-flight" deterministically.
"""

from __future__ import annotations

import threading

import pytest
from p2pkv.contracts import EMPTY_POLL, CancelMode
from p2pkv.errors import PeerRejected, TransferSubmitError
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


def test_wait_cancel_stops_a_running_transfer_and_forgets_it(make_local, doomed) -> None:
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport
    first, *rest = sorted(ids)

    assert t.cancel([first], CancelMode.WAIT) == []  # NIXL aborts it: forgotten
    assert t.cancel(rest, CancelMode.IMMEDIATE) == []
    doomed.resume()
    for _ in range(20):
        assert t.poll("c") == EMPTY_POLL
    assert t.close() == []


def test_wait_cancel_refused_keeps_the_id_until_it_ends(
    make_local, doomed, record, wait_for
) -> None:
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport
    recorder = record(t)
    recorder.refuse_running_release = True

    assert sorted(t.cancel(sorted(ids), CancelMode.WAIT)) == sorted(ids)
    doomed.resume()
    done, failed = wait_for(t, "c", ids)
    assert done == ids and not failed


def test_close_waits_for_transfers_before_releasing_anything(
    make_local, doomed, record, when
) -> None:
    """NIXL refuses to cancel (simulated); close must poll until the writes end, then release
    transfer handles, then the peer's descriptor list and agent, then deregister memory."""
    producer, _, ids = _stalled(make_local, doomed)
    t = producer.transport
    recorder = record(t)
    recorder.refuse_running_release = True
    closing = threading.Event()
    recorder.on_check = closing.set
    when(closing, doomed.resume)  # the consumer wakes up only once close() is polling

    assert t.close() == []

    names = recorder.names()
    assert names.count("release_refused") >= len(ids)
    last_xfer_release = max(i for i, n in enumerate(names) if n == "release_xfer_handle")
    first_dlist_release = names.index("release_dlist_handle")
    assert last_xfer_release < first_dlist_release
    assert names.index("remove_remote_agent") > first_dlist_release
    assert names[-2:] == ["deregister_memory", "deregister_memory"]  # scratch, then region
    assert names.count("release_dlist_handle") == 2  # the peer's, then ours
    released = [d for n, d in recorder.calls if n == "release_xfer_handle"]
    for handle in released:  # every handle was seen terminal before it was released
        assert recorder.state[handle] in ("DONE", "ERR")


def test_close_cancels_running_transfers_before_deregistering(make_local, doomed, record) -> None:
    producer, _, ids = _stalled(make_local, doomed)
    recorder = record(producer.transport)

    assert producer.transport.close() == []

    names = recorder.names()
    assert names.count("release_xfer_handle") == len(ids) + 1  # and the warm-up READ
    assert max(i for i, n in enumerate(names) if n == "release_xfer_handle") < names.index(
        "release_dlist_handle"
    )
    assert names[-2:] == ["deregister_memory", "deregister_memory"]


def test_close_that_cannot_drain_keeps_memory_registered_and_can_retry(
    make_local, doomed, record
) -> None:
    producer, _, ids = _stalled(make_local, doomed, drain_timeout=0.2)
    t = producer.transport
    recorder = record(t)
    recorder.refuse_running_release = True

    assert sorted(t.close()) == sorted(ids)
    assert "deregister_memory" not in recorder.names()
    assert "release_dlist_handle" not in recorder.names()
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
    recorder.refuse_running_release = True

    assert sorted(t.remove_peer("c")) == sorted(ids)
    assert "release_dlist_handle" not in recorder.names()
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        t.write_blocks("c", [0], [0])

    doomed.resume()
    done, failed = wait_for(t, "c", ids)
    assert done == ids and not failed
    assert recorder.names().count("release_dlist_handle") == 1  # released once quiescent
    assert "remove_remote_agent" in recorder.names()
