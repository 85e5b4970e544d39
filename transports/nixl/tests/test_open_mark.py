"""The open mark: a reader on the ``cma`` lane sees the owner's token while it is open and
never after its ``close`` began; a read that ends after the owner's close fails."""

from __future__ import annotations

import multiprocessing
import os
import time

from p2pkv.contracts import DataSettings, ReadState
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.open_mark import MarkReader, OpenMark
from p2pkv_nixl.transport import NixlDataTransport


def test_a_mark_holds_its_token_until_cleared() -> None:
    mark = OpenMark()
    reader = MarkReader(os.getpid(), mark.address, mark.token)
    assert mark.token & 1 and reader.holds()
    assert not MarkReader(os.getpid(), mark.address, mark.token ^ 2).holds()
    mark.clear()
    assert not reader.holds()


def test_marks_are_distinct_and_never_freed() -> None:
    marks = [OpenMark() for _ in range(5000)]  # more than one arena
    assert len({m.address for m in marks}) == len(marks)
    assert all(MarkReader(os.getpid(), m.address, m.token).holds() for m in marks[::500])


def test_a_gone_process_never_holds() -> None:
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join(60)
    mark = OpenMark()
    assert not MarkReader(child.pid or 0, mark.address, mark.token).holds()


def _transport(blocks: int = 4, block_len: int = 4096) -> NixlDataTransport:
    region = memoryview(bytearray(blocks * block_len))
    return NixlDataTransport.create(DataSettings(region, block_len))


def test_the_descriptor_names_the_mark_and_close_clears_it() -> None:
    owner = _transport()
    desc = RegionDescriptor.decode(owner.descriptor(), "owner")
    reader = MarkReader(desc.pid, desc.mark, desc.token)
    assert desc.pid == os.getpid() and reader.holds()
    owner.close()
    assert not reader.holds()


def test_a_read_that_ends_after_the_owners_close_fails() -> None:
    """A direct read whose bytes were copied before the owner's close but whose completion is
    seen after it ends failed: the consumer cannot tell when its copy ran."""
    owner, reader = _transport(), _transport()
    reader.add_peer("owner", owner.descriptor())
    owner.add_peer("reader", reader.descriptor())
    assert reader.lane("owner") == "direct"
    read = reader.read_blocks("owner", [0], [1])
    owner.close()
    outcome = _poll_until_ended(reader, read)
    assert outcome == ReadState.FAILED
    reader.close()


def _poll_until_ended(transport: NixlDataTransport, read: int) -> ReadState:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = transport.poll()
        if read in result.done:
            return ReadState.DONE
        if read in result.failed:
            return ReadState.FAILED
    raise AssertionError(f"read {read} neither done nor failed in 60 s")
