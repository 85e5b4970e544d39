"""A wait-cancel must not claim a write stopped while it can still land (nixl data transport).

Everything the tier does on an abort, a dead peer or a shutdown rests on this: a store job's
slots are given back to the engine, and a region deregistered, only once the data transport
says nothing of theirs is in flight. NIXL cannot stop a posted UCX write (releasing its
handle "cancels" it, which UCX ignores for RMA, and NIXL reports success), so the transport
must keep such a write in flight and report it when it ends.

The write is made certain to be in flight: UCX on TCP needs the target's progress to complete
a write, and the target is paused (SIGSTOP) while the write is posted and cancelled.
"""

from __future__ import annotations

import numpy as np
import pytest
from p2pkv.contracts import CancelMode, DataSettings
from p2pkv.testing.peers import PeerHost, make_region
from p2pkv.testing.waiting import wait_until

nixl_transport = pytest.importorskip("p2pkv_nixl.transport")

BLOCK = 1 << 20
BLOCKS = 32
T = 30.0


def test_wait_cancel_keeps_a_write_the_backend_cannot_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # before either agent exists (the child inherits it)
    cls = nixl_transport.NixlDataTransport
    region = make_region(BLOCKS, BLOCK)
    region[:] = np.random.default_rng(7).integers(0, 256, region.size, dtype=np.uint8)
    local = cls.create(DataSettings(memoryview(region), BLOCK, {}))
    with PeerHost(timeout=T, name="chaos-cancel-target") as host:
        target = host.data_peer(cls, BLOCKS, BLOCK, {})
        local.add_peer("target", target.descriptor)
        done: list[int] = []
        failed: list[int] = []

        def poll() -> None:
            result = local.poll("target")
            done.extend(result.done)
            failed.extend(result.failed)

        warm = local.write_blocks("target", [0], [0])  # endpoint wired up before the pause
        wait_until(lambda: warm in done, timeout=T, what="a first write", pumps=[poll])

        host.pause()
        try:
            tid = local.write_blocks("target", list(range(BLOCKS)), list(range(BLOCKS)))
            kept = local.cancel([tid], CancelMode.WAIT)
        finally:
            host.resume()
        assert kept == [tid], (
            "wait-cancel claimed a write stopped while its target was paused: the write "
            "cannot have finished, and NIXL cannot stop it"
        )
        wait_until(lambda: tid in done or tid in failed, timeout=T,
                   what="the kept write to end", pumps=[poll])
        if tid in done:  # it was live all along: every byte landed
            assert target.region_bytes() == region.tobytes()
    assert local.close() == []
