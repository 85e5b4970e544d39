"""What every data suite shares: the region shape, the knobs, and the fixtures that build the
transport under test and its peers (see :mod:`p2pkv.testing.suites`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest

from p2pkv.contracts import Capabilities, DataTransport, TransportKind
from p2pkv.testing.peers import DataPeer, LocalDataPeer, PeerHost
from p2pkv.testing.suites.data_pair import _DataPair
from p2pkv.testing.suites.support import _SuiteBase
from p2pkv.testing.waiting import quietly


class DataSuiteBase(_SuiteBase):
    """The data suites' base: knobs and fixtures, no tests."""

    kind: ClassVar[TransportKind] = "data"
    num_blocks: ClassVar[int] = 16
    block_len: ClassVar[int] = 256
    late_landing_window: ClassVar[float] = 0.5
    """Seconds the late-landing tests keep both sides progressing after a read was ended."""
    poll_budget: ClassVar[int] = 100
    """Polls of each side within which one read, alone in an idle process, must complete."""

    # -- fixtures -------------------------------------------------------------------------

    @pytest.fixture
    def make_peer(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
        request: pytest.FixtureRequest,
    ) -> Iterator[Callable[..., DataPeer]]:
        """``make_peer(mode, num_blocks=None, block_len=None, host=None)`` -> an open peer."""
        made: list[DataPeer] = []

        def make(
            mode: str,
            num_blocks: int | None = None,
            block_len: int | None = None,
            host: PeerHost | None = None,
        ) -> DataPeer:
            n = num_blocks or self.num_blocks
            b = block_len or self.block_len
            peer: DataPeer
            if mode == "same-process":
                peer = LocalDataPeer(transport_class, n, b, transport_options)
            else:
                host = host or request.getfixturevalue("peer_host")
                peer = host.data_peer(transport_class, n, b, transport_options)
            made.append(peer)
            return peer

        yield make
        for peer in made:
            quietly(peer.resume)
            quietly(peer.close)

    @pytest.fixture
    def local(
        self,
        transport_class: type[DataTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> Iterator[LocalDataPeer]:
        if "DRAM" not in capabilities.memory_kinds:  # a skip here would skip every data test
            pytest.fail(
                f"{transport_class.__name__} declares memory_kinds="
                f"{sorted(capabilities.memory_kinds)}: a p2pkv data transport must register "
                f"host memory (vLLM's CPU tier region: process memory or a /dev/shm mapping), "
                f"so memory_kinds must include 'DRAM' (memory your allocate_region returns, "
                f"/dev/shm or pinned, is DRAM too); the data suites run on it",
                pytrace=False,
            )
        local = LocalDataPeer(transport_class, self.num_blocks, self.block_len, transport_options)
        local.fill(1)
        yield local
        quietly(local.close)

    @pytest.fixture
    def pair(
        self, local: LocalDataPeer, make_peer: Callable[..., DataPeer], peer_mode: str
    ) -> _DataPair:
        """The transport under test and one peer (``"remote"``), registered both ways."""
        pair = _DataPair(local, self.timeout, self.late_landing_window)
        pair.connect("remote", make_peer(peer_mode), seed=2)
        return pair
