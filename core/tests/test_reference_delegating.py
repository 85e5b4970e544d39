"""The delegating wrappers forward every member of their contract, so a wrapper built on them
(fault injection, recording) never silently drops an optional one."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from p2pkv.contracts import ControlSettings, ControlTransport, DataSettings, DataTransport
from p2pkv.reference import MemoryControlTransport, MemoryDataTransport
from p2pkv.reference.delegating import DelegatingControlTransport, DelegatingDataTransport

NOT_FORWARDED = {"create", "availability", "allocate_region", "check_read"}
"""Class-level constructors and helpers of the base that work on the wrapper itself."""


def contract_members(contract: type) -> set[str]:
    return {
        name
        for name, _ in inspect.getmembers(contract)
        if not name.startswith("_")
        and name not in NOT_FORWARDED
        and name not in {"name", "kind", "capabilities"}
    }


@pytest.mark.parametrize(
    ("contract", "wrapper"),
    [
        (ControlTransport, DelegatingControlTransport),
        (DataTransport, DelegatingDataTransport),
    ],
)
def test_every_member_of_the_contract_is_forwarded(contract: type, wrapper: type) -> None:
    missing = {m for m in contract_members(contract) if m not in vars(wrapper)}
    assert not missing, f"{wrapper.__name__} does not forward {sorted(missing)}"


def test_a_delegating_data_transport_moves_the_inner_transports_bytes() -> None:
    region, source_region = np.zeros(4 * 16, np.uint8), np.arange(4 * 16, dtype=np.uint8)
    inner = MemoryDataTransport.create(DataSettings(region.data, 16))
    with (
        DelegatingDataTransport(inner) as ours,
        MemoryDataTransport.create(DataSettings(source_region.data, 16)) as peer,
    ):
        assert (ours.num_blocks, ours.block_len) == (4, 16)
        assert ours.capabilities == MemoryDataTransport.capabilities
        ours.add_peer("p", peer.descriptor())
        tid = ours.read_blocks("p", [0], [2])
        for _ in range(100):
            result = ours.poll()
            if result.done or result.failed:
                break
        assert list(result.done) == [tid]
        assert bytes(region[:16]) == bytes(source_region[32:48])


def test_a_delegating_control_transport_reports_the_inner_transports_address() -> None:
    inner = MemoryControlTransport.create(ControlSettings(host="127.0.0.1", port=0))
    with pytest.raises(TypeError, match="wraps a transport instance"):
        DelegatingControlTransport.create(ControlSettings(host="127.0.0.1", port=0))
    wrapper = DelegatingControlTransport(inner)
    try:
        assert wrapper.local_address == inner.local_address
        assert wrapper.silence_timeout == inner.silence_timeout
        assert wrapper.capabilities == MemoryControlTransport.capabilities
    finally:
        wrapper.close()
