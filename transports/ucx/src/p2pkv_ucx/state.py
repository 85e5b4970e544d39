"""The ``ucx`` transport's shared state: UCX objects, our region's layout and the tables.

One :class:`UcxState` per transport, owned by :class:`~p2pkv_ucx.transport.UcxDataTransport`
and handed to each role (:mod:`~p2pkv_ucx.peers`, :mod:`~p2pkv_ucx.reads`,
:mod:`~p2pkv_ucx.receiving`, :mod:`~p2pkv_ucx.notices`, :mod:`~p2pkv_ucx.serving`,
:mod:`~p2pkv_ucx.teardown`); the roles hold no state of their own and no reference to each
other beyond what their constructors name.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger
from p2pkv.runs import per_slice, region_slice_starts

from p2pkv_ucx import library, tags, wire
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.records import Ghost, Peer, Read, Receive, Serve
from p2pkv_ucx.staging import Bytes, Staging

__all__ = ["UcxState"]

log = module_logger("p2pkv_ucx.transport")
"""The roles' logger: still the transport module's name, as before the split."""


class UcxState:
    """Everything the roles share, each item with this one owner.

    Driver thread only (one at a time), like the transport. Created with our UCX context
    and worker (``ConfigError`` when UCX refuses to start); the tables start empty. Besides
    plain data it only sends NOTICEs (:meth:`send_notice`), which every role needs.
    """

    def __init__(
        self,
        lib: library.Ucxx,
        options: UcxOptions,
        blocks: np.ndarray[Any, Any],
        transfer_ids: Iterator[int],
    ) -> None:
        self.lib, self.opts, self.blocks, self.transfer_ids = lib, options, blocks, transfer_ids
        """The region as ``(num_blocks, block_len)`` and the base's id sequence (serves)."""
        self.num_blocks, self.block_len = blocks.shape
        api = lib.api
        self.tag, self.mask, self.array = api.UCXXTag, api.UCXXTagMask, lib.array
        self.address = self._start_ucx(api, options)
        self.max_run = (
            max(1, options.max_message_bytes // self.block_len) if options.coalesce else 1
        )
        self.slice_blocks = min(per_slice(options.slice_bytes, self.block_len), self.num_blocks)
        """Blocks per slice of our region (``num_blocks``: one slice); sends never cross one."""
        self.slices: Indexes = region_slice_starts(self.num_blocks, self.slice_blocks)
        self.instance = secrets.randbits(62) | 1
        self.timeout = options.transfer_timeout if options.transfer_timeout > 0 else math.inf
        self.links = itertools.count(1)
        self.posted = 0
        """DATA messages posted (the transport's ``descriptors_posted``)."""
        self._init_tables()

    def _init_tables(self) -> None:
        self.peers: set[Peer] = set()
        """Peer records the base holds (added, not yet removed or replaced)."""
        self.retired: set[Peer] = set()
        """Removed peers whose endpoints are still needed (sends serving them, ghosts)."""
        self.by_instance: dict[int, Peer] = {}
        self.early: dict[int, list[wire.Notice]] = {}
        """Notices of senders not added yet, by their instance."""
        self.live: dict[int, Read] = {}
        """Live reads by (link, rid) key: what an arriving DATA message may belong to."""
        self.ghosts: dict[int, Ghost] = {}
        """Ended reads whose runs may still arrive, by read key, in order of ending."""
        self.serves: dict[int, Serve] = {}
        self.pending: dict[tuple[int, int, int], tuple[Peer, wire.Read]] = {}
        """READs of this pump's notices, served after the batch (a CANCEL may follow)."""
        self.receiving: list[Receive] = []
        self.staging: Staging[Peer] = Staging(
            self.block_len, self.opts.staging_bytes, self.max_run * self.block_len
        )
        self.inbox: dict[int, deque[tuple[Any, Bytes]]] = {}
        """NOTICE receives by sender (its tag's sender part), each sender's in order."""
        self.drains: list[Any] = []
        self.scratch: Bytes | None = None
        self.orphans: list[Serve] = []
        self.loose: list[tuple[Any, Any]] = []
        """Notice sends nobody waits for, with their payloads, until UCX is done with them."""
        self.control_limit = 64 + 12 * self.num_blocks

    def _start_ucx(self, api: Any, options: UcxOptions) -> bytes:
        """Create our UCX context and worker; returns the worker's address."""
        config = {k.removeprefix("UCX_"): v for k, v in options.ucx_config.items()}
        try:
            with library.ucx_environment(self.lib.env):
                self.ctx: Any = api.UCXContext(config_dict=config, feature_flags=(api.Feature.TAG,))
            self.worker: Any = api.UCXWorker(self.ctx)
            return bytes(self.worker.address.tobytes())
        except Exception as exc:
            raise ConfigError(f"UCX refused to start ({type(exc).__name__}: {exc})") from exc

    def notify(self, peer: Peer, payload: bytes) -> tuple[Any, Bytes]:
        """Send ``peer`` a NOTICE; returns its request and the payload UCX reads from.
        Raises what ucxx raises (a failed endpoint refuses sends)."""
        data = np.frombuffer(payload, np.uint8)
        return peer.ep.tag_send(self.array(data), self.tag(tags.notice_tag(self.instance))), data

    def send_notice(self, peer: Peer, payload: bytes) -> None:
        """Send a NOTICE nobody waits for (its payload is kept until UCX is done with it);
        a failed endpoint is logged, not raised: the peer learns nothing, deadlines rule."""
        try:
            self.loose.append(self.notify(peer, payload))
        except Exception as exc:
            log.info("ucx: notice to peer %r not sent: %s", peer.peer_id, exc)

    def forget_released(self) -> None:
        """Forget orphans, drains and notice sends UCX let go of."""
        if self.orphans:
            self.orphans = [s for s in self.orphans if not s.settle()]
        if self.drains:
            self.drains = [r for r in self.drains if not r.completed]
        if self.loose:
            self.loose = [(r, keep) for r, keep in self.loose if not r.completed]
