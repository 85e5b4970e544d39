"""A cancelled read is final, over the real nixl and ucx transports, in two processes.

Everything the consumer does on a failure rests on this (docs/protocol.md §1, "the consumer owns
every write into its region"): a load that fails cancels its reads and hands its slots back
to the engine *at once*, with no fence and no word from the producer, so once ``cancel``
returned no byte of the read may land in our region any more, whatever the source does later.

The consumer (this process) posts a large read from a source in a child process and gets it
going; the source is SIGSTOPped mid-read, the consumer cancels and at once reuses the
destination: it fills it with a canary. The source is SIGCONTed and serves on, the consumer
keeps progressing and polling for two seconds (a bounded loop) and checks the canary every
round: not a byte changes, and the cancelled read is never reported. A fresh read of the same
slots then brings the source's bytes. With the library's default lanes (on one host: shared
memory, CMA) and with ``UCX_TLS=tcp`` in both processes, where a read needs the source's
progress to move, so it is certainly still in flight when the source stops.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from chaos_cluster import measured
from p2pkv.contracts import DataSettings
from p2pkv.errors import TransferBusy
from p2pkv.registry import default_registry
from p2pkv.testing.peers import PeerHost, make_region, pattern
from p2pkv.testing.waiting import wait_until

BLOCK = 1 << 20
BLOCKS = 96
READ = list(range(1, BLOCKS))
"""Our slots of the large read (slot 0 wires the endpoint up first)."""
DEST = slice(1, BLOCKS)
"""The same slots as a view of the region (checked without copying it)."""
WINDOW = 2.0
"""Seconds both sides keep going after the resume while the canary is watched."""
GET_GOING = 0.03
"""Seconds the consumer progresses between posting the read and stopping its source (a bounded
loop; long enough for part of the read to move, far too short for all of it over TCP)."""
SEED = 7
T = 60.0


@pytest.mark.parametrize("lanes", ["default", "tcp"])
def test_a_cancelled_read_never_lands_after_its_paused_source_resumes(
    data: str,
    lanes: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if lanes == "tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")  # before either side exists (the child inherits it)
    cls = default_registry().transport("data", data)
    region = make_region(BLOCKS, BLOCK)
    blocks = region.reshape(BLOCKS, BLOCK)
    source_bytes = pattern(SEED, BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
    remote = READ[::-1]  # every destination block gets a different source block
    local = cls.create(DataSettings(region.data, BLOCK, {}))
    done: list[int] = []
    failed: list[int] = []
    try:
        with PeerHost(timeout=T, name="chaos-cancel-source") as host:
            source = host.data_peer(cls, BLOCKS, BLOCK, {})
            source.fill(SEED)
            local.add_peer("source", source.descriptor)
            source.add_peer("consumer", local.descriptor())  # a two-sided source serves peers

            def poll() -> None:
                result = local.poll("source")
                done.extend(result.done)
                failed.extend(result.failed)

            warm = local.read_blocks("source", [0], [0])  # endpoint wired before the pause
            wait_until(lambda: warm in done, timeout=T, what="a first read", pumps=[poll])

            tid = local.read_blocks("source", READ, remote)
            posted = time.monotonic()
            while time.monotonic() - posted < GET_GOING:
                local.progress()  # the read is under way (never reported by progress)
            host.pause()
            try:
                landed = sum(
                    np.array_equal(blocks[s], source_bytes[r])
                    for s, r in zip(READ, remote, strict=True)
                )
                local.cancel([tid])
                canary = pattern(SEED + 1, len(READ) * BLOCK).reshape(len(READ), BLOCK)
                blocks[DEST] = canary  # the engine reuses the slots at once
            finally:
                host.resume()
            resumed = time.monotonic()
            checks = 0
            while True:  # both sides keep going for WINDOW seconds; the canary is checked
                poll()
                local.progress()
                checks += 1
                assert np.array_equal(blocks[DEST], canary), (
                    f"bytes landed in our blocks {time.monotonic() - resumed:.3f}s after the "
                    f"source resumed, from a read cancelled while it was stopped "
                    f"({int((blocks[DEST] != canary).sum())} bytes changed)"
                )
                if time.monotonic() - resumed >= WINDOW:
                    break
            assert tid not in done and tid not in failed, "a cancelled read was reported"

            posts: list[int] = []

            def post_again() -> bool:
                """The fresh read, once it fits: ``TransferBusy`` is back-pressure (nixl's
                staging blocks stay quarantined until NIXL reports the cancelled read
                ended), the contract's "retry once reads ended"."""
                try:
                    posts.append(local.read_blocks("source", READ, remote))
                except TransferBusy:
                    return False
                return True

            wait_until(post_again, timeout=T, what="the fresh read posted", pumps=[poll])
            (again,) = posts
            wait_until(
                lambda: again in done or again in failed,
                timeout=T,
                what="a fresh read of the same slots",
                pumps=[poll],
            )
            assert again in done, "a fresh read of the cancelled read's slots failed"
            assert np.array_equal(blocks[DEST], source_bytes[remote]), (
                "a fresh read into the cancelled read's slots did not bring the source's bytes"
            )
            measured(
                f"[{data}, {lanes} lanes] read of {len(READ)} x {BLOCK >> 20} MiB "
                f"cancelled with its source stopped ({landed} blocks had landed before "
                f"the cancel): canary intact over {checks} checks in {WINDOW}s after the "
                f"resume; a fresh read of the slots exact"
            )
    finally:
        undrained = local.close()
    assert undrained == [], f"close() left internal transfers undrained: {undrained}"
