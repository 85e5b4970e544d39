"""The tier's call guard (``p2pkv.call_guard``): every data transport call that may do I/O is
timed against the driver bound, and one over it is counted and logged, naming it."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from p2pkv.call_guard import GuardedDataTransport
from p2pkv.contracts import DataSettings
from p2pkv.reference.data import MemoryDataTransport


class _SlowRemove(MemoryDataTransport):
    def remove_peer(self, peer_id: str) -> list[int]:
        threading.Event().wait(0.05)  # a call that blocks (for longer than the test's bound)
        return super().remove_peer(peer_id)


def _pair(cls: type[MemoryDataTransport]) -> tuple[GuardedDataTransport, MemoryDataTransport]:
    ours = cls.create(DataSettings(np.zeros(64, np.uint8).data, 16))
    theirs = MemoryDataTransport.create(DataSettings(np.arange(64, dtype=np.uint8).data, 16))
    guarded = GuardedDataTransport(ours, bound=0.01)
    guarded.add_peer("p", theirs.descriptor())
    return guarded, theirs


def test_calls_within_the_bound_pass_through_silently(caplog: pytest.LogCaptureFixture) -> None:
    guarded, theirs = _pair(MemoryDataTransport)
    with caplog.at_level(logging.WARNING, logger="p2pkv"):
        tid = guarded.read_blocks("p", [0], [3])
        guarded.progress()
        assert list(guarded.poll("p").done) == [tid]
        assert guarded.remove_peer("p") == []
        assert guarded.close() == []
    theirs.close()
    assert guarded.overruns == 0 and not caplog.text


def test_a_call_over_the_bound_is_counted_and_logged_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guarded, theirs = _pair(_SlowRemove)
    with caplog.at_level(logging.WARNING, logger="p2pkv"):
        assert guarded.remove_peer("p") == []
    guarded.close()
    theirs.close()
    assert guarded.overruns == 1 and guarded.slowest[0] == "remove_peer"
    assert "memory data transport's remove_peer took" in caplog.text
    assert "over the driver bound (0.01s)" in caplog.text
