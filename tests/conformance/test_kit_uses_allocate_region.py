"""The kit gets every region from the transport class's ``allocate_region``: a transport that
can register only ``/dev/shm`` mappings of its own is tested on exactly those, and passes."""

from __future__ import annotations

import mmap
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.contracts import DataSettings
from p2pkv.errors import ConfigError, PeerRejected
from p2pkv.testing.peers import LocalDataPeer
from p2pkv.testing.stateful import DataTransportMachine
from p2pkv.testing.suites import DataTransportSuite
from socket_transport import SocketDataTransport

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


def _address(region: memoryview) -> int:
    return int(np.frombuffer(region, dtype=np.uint8).ctypes.data)


class ShmOnlyTransport(SocketDataTransport):
    """The reference transport, refusing any region but a ``/dev/shm`` mapping it allocated."""

    name: ClassVar[str] = "kit-socket-shm"
    allocated: ClassVar[set[int]] = set()
    """Addresses of the mappings ``allocate_region`` made in this process."""

    @classmethod
    def allocate_region(
        cls, num_blocks: int, block_len: int, options: Mapping[str, Any]
    ) -> memoryview:
        with tempfile.TemporaryFile(dir="/dev/shm") as backing:
            backing.truncate(num_blocks * block_len)
            region = memoryview(mmap.mmap(backing.fileno(), num_blocks * block_len))
        cls.allocated.add(_address(region))
        return region

    def __init__(self, settings: DataSettings) -> None:
        if _address(settings.region) not in self.allocated:
            raise ConfigError("kit-socket-shm registers only /dev/shm regions it allocated")
        super().__init__(settings)

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        # The reference accepts add_peer after close (the contract: PeerRejected); until
        # socket_transport.py refuses it, this subclass does, so only allocate_region is tested.
        if self._blocks is None:
            raise PeerRejected("kit-socket-shm data transport is closed")
        super().add_peer(peer_id, descriptor)


def test_the_kit_peer_holds_the_transports_own_memory() -> None:
    peer = LocalDataPeer(ShmOnlyTransport, 4, 64, {})
    try:
        assert isinstance(peer.region.obj, mmap.mmap)
        assert _address(peer.region) in ShmOnlyTransport.allocated
    finally:
        peer.close()


def test_process_memory_is_refused() -> None:
    region = np.zeros(256, dtype=np.uint8).data
    with pytest.raises(ConfigError):
        ShmOnlyTransport.create(DataSettings(region=region, block_len=64))


class TestShmOnlyTransport(DataTransportSuite):
    transport = ShmOnlyTransport
    timeout = 5.0


@pytest.mark.hypothesis
def test_data_machine_on_shm_regions() -> None:
    machine: Any = type(
        "ShmMachine", (DataTransportMachine,), {"transport": ShmOnlyTransport, "timeout": 5.0}
    )
    run_state_machine_as_test(machine)
