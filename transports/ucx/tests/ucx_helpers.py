"""Shared helpers of the ucx transport tests (a unique module name: other test directories
have their own ``conftest``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from p2pkv.contracts import DataSettings
from p2pkv.testing.waiting import wait_until
from p2pkv_ucx import UcxDataTransport

FAST = {"transfer_timeout": 10.0, "drain_timeout": 0.5}
"""Short drains; a transfer deadline well above any healthy transfer in these tests."""
T = 15.0
"""Seconds any awaited event may take."""


class Node:
    """One in-process transport over its own region (``blocks``: a numpy row per block)."""

    def __init__(
        self, num_blocks: int = 32, block_len: int = 1024, seed: int = 0, **options: Any
    ) -> None:
        self.array = np.random.default_rng(seed).integers(
            0, 256, num_blocks * block_len, dtype=np.uint8
        )
        self.blocks = self.array.reshape(num_blocks, block_len)
        self.t = UcxDataTransport.create(
            DataSettings(region=self.array.data, block_len=block_len, options={**FAST, **options})
        )
        self.done: set[int] = set()
        self.failed: set[int] = set()

    def poll(self, peer: str | None = None) -> None:
        """Poll and record what was reported; a second report of an id fails the test."""
        result = self.t.poll(peer)
        for tid in [*result.done, *result.failed]:
            assert tid not in self.done | self.failed, f"read {tid} reported twice"
        self.done.update(result.done)
        self.failed.update(result.failed)

    def link(self, peer_id: str, other: Node, back_as: str) -> None:
        self.t.add_peer(peer_id, other.t.descriptor())
        other.t.add_peer(back_as, self.t.descriptor())


def settle(nodes: list[Node], ids: dict[Node, set[int]], what: str) -> None:
    """Poll every node until each id of ``ids[node]`` is done or failed on that node."""
    wait_until(
        lambda: all(i <= (n.done | n.failed) for n, i in ids.items()),
        timeout=T,
        what=what,
        pumps=[n.poll for n in nodes],
    )


class RawProducer:
    """A hand-driven producer speaking the transport's wire with bare ucxx: it takes the
    consumer's notices and sends whatever DATA a test wants (runs of cancelled or unknown
    reads, wrong lengths, repeats), which the real producer never would."""

    def __init__(self, num_blocks: int, block_len: int) -> None:
        from p2pkv_ucx import library, wire

        self.lib = library.load()
        api = self.lib.api
        self.worker = api.UCXWorker(api.UCXContext(feature_flags=(api.Feature.TAG,)))
        self.instance = 424242
        self.descriptor = wire.encode_descriptor(
            wire.Descriptor(
                self.worker.address.tobytes(), self.instance, num_blocks, block_len, 64, True
            )
        )
        self.ep: Any = None
        self.keep: list[Any] = []

    def connect(self, consumer_descriptor: bytes) -> None:
        from p2pkv_ucx import wire

        api = self.lib.api
        address = wire.decode_descriptor(consumer_descriptor).address
        self.ep = api.UCXEndpoint.create_from_worker_address(
            self.worker, api.UCXAddress.create_from_buffer(address), True
        )

    def notice(self, pump: Any) -> Any:
        """The next NOTICE from the consumer (decoded), pumping ``pump`` meanwhile."""
        from p2pkv_ucx import tags, wire

        api = self.lib.api
        tag, mask = api.UCXXTag(tags.kind_tag(tags.NOTICE)), api.UCXXTagMask(tags.KIND_MASK)

        def probe() -> Any:
            self.worker.progress()
            return self.worker.tag_probe(tag, mask, remove=True)

        found = wait_until(
            lambda: (p := probe()).matched and p,
            timeout=T,
            what="a NOTICE from the consumer",
            pumps=[pump],
        )
        buf = np.empty(found.length, np.uint8)
        req = self.worker.tag_recv_with_handle(self.lib.array(buf), found)
        wait_until(
            lambda: req.completed,
            timeout=T,
            what="the NOTICE payload",
            pumps=[self.worker.progress, pump],
        )
        return wire.decode_notice(buf.tobytes())

    def send_run(self, link: int, rid: int, run: int, payload: np.ndarray) -> Any:
        """Send ``payload`` as run ``run`` of read ``rid`` on ``link``."""
        from p2pkv_ucx import tags

        self.keep.append(payload)
        tag = self.lib.api.UCXXTag(tags.data_tag(link, rid, run))
        return self.ep.tag_send(self.lib.array(payload), tag)

    def send_notice(self, payload: bytes) -> Any:
        from p2pkv_ucx import tags

        data = np.frombuffer(payload, np.uint8)
        self.keep.append(data)
        return self.ep.tag_send(
            self.lib.array(data), self.lib.api.UCXXTag(tags.kind_tag(tags.NOTICE))
        )
