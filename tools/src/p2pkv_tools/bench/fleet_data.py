"""The fleet simulator's data plane: block reads between processes of this host, through a
region each tier allocates in anonymous shared memory.

``p2pkv bench --fleet`` measures the control plane and the tier at fleet scale, so its data
plane must be cheap per peer: a thousand NIXL agents (a UCX worker and threads each) would
not fit this host. :class:`ShmDataTransport` is the ``memory`` transport's idea across
processes. ``allocate_region`` makes the region a ``memfd`` mapping; the descriptor names it
as ``/proc/<pid>/fd/<fd>`` (the file has no name, so nothing is left behind when the process
dies). A read opens that path, copies the blocks with ``preadv`` into ours, and closes it: no
descriptor is held per peer, and a read is done when ``read_blocks`` returns. The consumer
still owns every write into its region.

Not a product transport: it is built by :func:`fleet_registry` only, beside the installed
``zmq`` control transport, and never registered for users.

Threading: one driver thread per transport, as the contract says.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any, ClassVar, TypeGuard

import msgpack
import numpy as np
from p2pkv.contracts import Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError
from p2pkv.hookspecs import hookimpl
from p2pkv.registry import Registry, default_registry

__all__ = ["ShmDataTransport", "fleet_registry"]

_NAME = "fleet-shm"
_REGIONS: dict[int, tuple[int, mmap.mmap]] = {}
"""Buffer address of a region this process allocated -> (its memfd, its mapping)."""


class _Peer:
    __slots__ = ("num_blocks", "path")

    def __init__(self, path: str, num_blocks: int) -> None:
        self.path = path
        self.num_blocks = num_blocks


class ShmDataTransport(DataTransport):
    """Reads from peers' ``memfd`` regions on this host (see the module docstring)."""

    name: ClassVar[str] = _NAME
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        if settings.options:
            raise ConfigError(f"{_NAME} data takes no options, got {sorted(settings.options)}")
        super().__init__(settings)
        entry = _REGIONS.get(int(self._blocks.ctypes.data))
        if entry is None:
            raise ConfigError(f"{_NAME} data needs a region from its allocate_region")
        self._fd = entry[0]
        self._path = f"/proc/{os.getpid()}/fd/{self._fd}"

    @classmethod
    def allocate_region(
        cls, num_blocks: int, block_len: int, options: Mapping[str, Any]
    ) -> memoryview:
        size = num_blocks * block_len
        fd = os.memfd_create(f"p2pkv-fleet-{os.getpid()}")
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        region = memoryview(mapping)
        _REGIONS[int(np.frombuffer(region, dtype=np.uint8).ctypes.data)] = (fd, mapping)
        return region

    def descriptor(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "transport": _NAME,
                "path": self._path,
                "num_blocks": self.num_blocks,
                "block_len": self.block_len,
            }
        )
        return packed

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> _Peer:
        desc: Any = msgpack.unpackb(descriptor, raw=False)
        if not isinstance(desc, dict) or desc.get("transport") != _NAME:
            raise PeerRejected(f"peer {peer_id!r}: not a {_NAME} descriptor")
        path, num_blocks = desc.get("path"), desc.get("num_blocks")
        if not isinstance(path, str) or not _is_count(num_blocks):
            raise PeerRejected(f"peer {peer_id!r}: malformed {_NAME} descriptor {desc!r}")
        if desc.get("block_len") != self.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.get('block_len')} is not "
                f"ours ({self.block_len})"
            )
        return _Peer(path, num_blocks)

    def _post_read(self, peer: _Peer, local: Indexes, remote: Indexes) -> bool:
        """Copy now; ``TransferSubmitError`` if the peer's region is gone."""
        try:
            fd = os.open(peer.path, os.O_RDONLY)
        except OSError as exc:
            raise TransferSubmitError(f"the peer's region is gone: {exc}") from exc
        try:
            block_len, blocks = self.block_len, self._blocks
            for dst, src in zip(local.tolist(), remote.tolist(), strict=True):
                if os.preadv(fd, [blocks[dst]], src * block_len) != block_len:
                    raise TransferSubmitError("the peer's region is shorter than announced")
        finally:
            os.close(fd)
        return True

    def _read_state(self, handle: bool) -> ReadState:
        return ReadState.DONE

    def _shutdown(self) -> list[int]:
        """Close the descriptor the path names: peers' reads fail from now on, and the
        region stays mapped for its caller."""
        os.close(self._fd)
        return []


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _FleetPlugin:
    """The simulator's plugin: the installed ``zmq`` control transport and this data one."""

    P2PKV_PLUGIN_API = 1

    def __init__(self, control: type[Any]) -> None:
        self._control = control

    @hookimpl
    def p2pkv_transports(self) -> list[type[Any]]:
        return [self._control, ShmDataTransport]


def fleet_registry() -> Registry:
    """A registry of the installed ``zmq`` control transport and :class:`ShmDataTransport`
    (``TransportUnavailable`` when zmq is not installed)."""
    control = default_registry().transport("control", "zmq")
    return Registry.from_plugins([("fleet", _FleetPlugin(control))])
