"""``data_options`` validation, the descriptor codec and the locality checks (no NIXL needed
for most of it)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nixl_fixtures import MakeLocal
from p2pkv.errors import ConfigError, PeerRejected
from p2pkv.runs import SLICE_BYTES, SLICE_BYTES_ENV
from p2pkv_nixl.descriptor import MAX_BLOCKS, RegionDescriptor
from p2pkv_nixl.locality import cma_usable, host_id, tls_allows_cma
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.slices import MAX_SLICES

# -- options -------------------------------------------------------------------------------


def test_defaults() -> None:
    options = NixlOptions.parse({})
    assert options == NixlOptions()
    assert options.backends == ("UCX",)
    assert options.enable_prog_thread is False
    assert options.drain_timeout == 5.0
    assert options.staging == "auto" and options.staging_blocks == 256
    assert options.init_params("UCX") == {}


def test_the_slice_size_default_comes_from_the_environment_and_the_option_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert NixlOptions.parse({}).slice_bytes == SLICE_BYTES == 7 * 2**29  # 3.5 GiB
    monkeypatch.setenv(SLICE_BYTES_ENV, "1048576")
    assert NixlOptions.parse({}).slice_bytes == 1048576
    assert NixlOptions.parse({"slice_bytes": 4096}).slice_bytes == 4096
    monkeypatch.setenv(SLICE_BYTES_ENV, "4GiB")
    with pytest.raises(ConfigError, match=f"{SLICE_BYTES_ENV}='4GiB': give the largest"):
        NixlOptions.parse({})
    assert NixlOptions.parse({"slice_bytes": 4096}).slice_bytes == 4096


def test_values_and_init_params() -> None:
    options = NixlOptions.parse(
        {
            "backends": ["UCX"],
            "num_threads": 2,
            "enable_prog_thread": True,
            "drain_timeout": 1,
            "warmup": False,
            "staging": "always",
            "staging_blocks": 1024,
            "backend_params": {"UCX": {"ucx_error_handling_mode": "none", "num_workers": 1}},
        }
    )
    assert options.drain_timeout == 1.0 and options.enable_prog_thread and not options.warmup
    assert options.staging == "always" and options.staging_blocks == 1024
    assert options.init_params("UCX") == {
        "num_threads": "2",
        "ucx_error_handling_mode": "none",
        "num_workers": "1",
    }


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"progress_thread": True}, "'progress_thread'"),
        ({"backends": "UCX"}, "'backends'"),
        ({"backends": []}, "'backends'"),
        ({"backends": ["UCX", "UCX"]}, "'backends'"),
        ({"backends": [""]}, "'backends'"),
        ({"num_threads": -1}, "'num_threads'"),
        ({"num_threads": True}, "'num_threads'"),
        ({"num_threads": 1.5}, "'num_threads'"),
        ({"enable_prog_thread": 1}, "'enable_prog_thread'"),
        ({"warmup": "yes"}, "'warmup'"),
        ({"drain_timeout": -1}, "'drain_timeout'"),
        ({"drain_timeout": float("nan")}, "'drain_timeout'"),
        ({"drain_timeout": "5"}, "'drain_timeout'"),
        ({"backend_params": {"GDS": {}}}, "'backend_params'"),
        ({"backend_params": {"UCX": {"x": None}}}, "'backend_params'"),
        ({"backend_params": ["UCX"]}, "'backend_params'"),
        ({"staging": "sometimes"}, "'staging'"),
        ({"staging": True}, "'staging'"),
        ({"staging": ["auto"]}, "'staging'"),
        ({"staging_blocks": 0}, "'staging_blocks'"),
        ({"staging_blocks": -3}, "'staging_blocks'"),
        ({"staging_blocks": True}, "'staging_blocks'"),
        ({"staging_blocks": "256"}, "'staging_blocks'"),
        ({"staging_blocks": MAX_BLOCKS + 1}, "'staging_blocks'"),
        ({"stageing": "auto"}, "'stageing'"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        NixlOptions.parse(options)


def test_unknown_backend_is_a_config_error(make_local: MakeLocal) -> None:
    with pytest.raises(ConfigError, match=r"'NOPE' is not available here; available: .*UCX"):
        make_local(backends=["NOPE"])


def test_region_must_be_whole_writable_blocks() -> None:
    from p2pkv.contracts import DataSettings
    from p2pkv_nixl import NixlDataTransport

    for region, block_len, says in [
        (memoryview(bytes(64)), 16, "writable"),
        (memoryview(bytearray(65)), 16, "multiple of block_len"),
        (memoryview(bytearray(64)), 0, "block_len"),
    ]:
        with pytest.raises(ConfigError, match=says):
            NixlDataTransport.create(DataSettings(region, block_len))


# -- descriptor ----------------------------------------------------------------------------

GOOD = RegionDescriptor(
    "p2pkv-agent",
    b"md",
    0x7F00_0000_0000,
    16,
    4096,
    "boot/host/ns",
    True,
    pid=4242,
    mark=0x7F00_1000_0000,
    token=2**64 - 1,
)


def _with(**changes: object) -> bytes:
    fields = msgpack.unpackb(GOOD.encode(), raw=False)
    for key, value in changes.items():
        if value is ...:
            del fields[key]
        else:
            fields[key] = value
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def test_roundtrip_and_extra_keys_are_ignored() -> None:
    assert RegionDescriptor.decode(GOOD.encode(), "p") == GOOD
    assert RegionDescriptor.decode(_with(future_field=[1, 2]), "p") == GOOD


def test_a_descriptor_without_an_open_mark_has_none() -> None:
    desc = RegionDescriptor.decode(_with(pid=..., mark=..., token=...), "p")
    assert (desc.pid, desc.mark, desc.token) == (0, 0, 0)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (msgpack.packb([1, 2]), "not a p2pkv-nixl descriptor"),
        (_with(format="p2pkv-memory"), "not a p2pkv-nixl descriptor"),
        (_with(v=2), "version 2"),
        (_with(v=4), "version 4"),
        (_with(host=...), "host None"),
        (_with(host=7), "host 7"),
        (_with(cma=...), "cma None"),
        (_with(cma=1), "cma 1"),
        (_with(agent=""), "agent name"),
        (_with(agent=...), "agent name"),
        (_with(metadata=b""), "metadata"),
        (_with(metadata="text"), "metadata"),
        (_with(mem="VRAM"), "DRAM only"),
        (_with(num_blocks=0), "num_blocks"),
        (_with(num_blocks=MAX_BLOCKS + 1), "num_blocks"),
        (_with(num_blocks=True), "num_blocks"),
        (_with(block_len=-4096), "block_len"),
        (_with(block_len=4096.0), "block_len"),
        (_with(base=0), "base address"),
        (_with(base=2**64 - 4096), "base address"),
        (_with(base="0x1000"), "base address"),
        (_with(slices=...), "slice list is not a list"),
        (_with(slices=[]), "slice list is not a list"),
        (_with(slices="16"), "slice list is not a list"),
        (_with(slices=[1] * (MAX_SLICES + 1), num_blocks=MAX_SLICES + 1), "slice list is not"),
        (_with(slices=[8, 8, 0]), "not a positive integer"),
        (_with(slices=[8.0, 8]), "not a positive integer"),
        (_with(slices=[True] * 16), "not a positive integer"),
        (_with(slices=[8, 7]), "covers 15 blocks, the region has 16"),
        (_with(slices=[8, 8, 8]), "covers 24 blocks"),
        (_with(pid=-1), "pid -1"),
        (_with(pid=2**31), "pid"),
        (_with(pid="1"), "pid"),
        (_with(mark="0x10"), "mark"),
        (_with(mark=-8), "mark"),
        (_with(token=1.5), "token"),
        (_with(token=True), "token"),
    ],
)
def test_bad_descriptors_are_rejected_with_a_reason(data: bytes, says: str) -> None:
    with pytest.raises(PeerRejected, match=f"peer 'p': .*{says}"):
        RegionDescriptor.decode(data, "p")


@given(st.binary(max_size=256))
def test_any_bytes_decode_or_are_rejected(data: bytes) -> None:
    try:
        RegionDescriptor.decode(data, "p")
    except PeerRejected:
        pass


@given(
    st.text(min_size=1, max_size=64),
    st.binary(min_size=1, max_size=512),
    st.integers(1, 2**40),
    st.integers(1, MAX_BLOCKS),
    st.integers(1, 2**22),
    st.text(max_size=80),
    st.booleans(),
)
def test_valid_descriptors_roundtrip(
    agent: str, metadata: bytes, base: int, num_blocks: int, block_len: int, host: str, cma: bool
) -> None:
    desc = RegionDescriptor(agent, metadata, base, num_blocks, block_len, host, cma)
    assert RegionDescriptor.decode(desc.encode(), "p") == desc


def test_add_peer_rejections_from_a_live_transport(make_local: MakeLocal) -> None:
    local = make_local(num_blocks=8, block_len=4096)
    t = local.transport
    own = RegionDescriptor.decode(t.descriptor(), "self")
    with pytest.raises(PeerRejected, match="our own"):
        t.add_peer("self", t.descriptor())
    wide = RegionDescriptor("other", own.metadata, own.base, 8, 8192).encode()
    with pytest.raises(PeerRejected, match="block_len 8192 does not match ours"):
        t.add_peer("wide", wide)
    garbage_md = RegionDescriptor("other", b"\x00" * 32, own.base, 8, 4096).encode()
    with pytest.raises(PeerRejected, match="cannot load its agent metadata"):
        t.add_peer("garbage", garbage_md)
    renamed = RegionDescriptor("not-its-name", own.metadata, own.base, 8, 4096).encode()
    with pytest.raises(PeerRejected):
        t.add_peer("renamed", renamed)


def test_a_live_descriptor_names_this_host_and_its_cma() -> None:
    from p2pkv.contracts import DataSettings
    from p2pkv_nixl import NixlDataTransport

    t = NixlDataTransport.create(DataSettings(memoryview(bytearray(8192)), 4096))
    try:
        desc = RegionDescriptor.decode(t.descriptor(), "self")
    finally:
        t.close()
    assert desc.host == host_id() and desc.host.count("/") == 2
    assert desc.cma is cma_usable()


# -- locality ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "allowed"),
    [
        (None, True),
        ("", True),
        ("  ", True),
        ("all", True),
        ("cma", True),
        ("tcp,cma", True),
        ("sm", True),
        ("shm,tcp", True),
        ("TCP,CMA", True),
        ("ud:aux,cma", True),
        ("^tcp", True),
        ("^rc,ud", True),
        ("tcp", False),
        ("tcp,self", False),
        ("posix,sysv,tcp", False),
        ("rc,ud", False),
        ("^cma", False),
        ("^sm", False),
        ("^shm,tcp", False),
        ("^all", False),
    ],
)
def test_which_ucx_tls_values_leave_cma(tls: str | None, allowed: bool) -> None:
    assert tls_allows_cma(tls) is allowed


def test_cma_follows_ucx_tls() -> None:
    assert cma_usable({"UCX_TLS": "tcp"}) is False
    assert cma_usable({"UCX_TLS": "^cma"}) is False
    assert cma_usable({}) is cma_usable({"UCX_TLS": "all"})
