"""What a peer needs to read from our region: NIXL agent metadata plus the region's shape.

Wire form: a msgpack map (never pickle) ::

    {
        "format": "p2pkv-nixl",
        "v": 3,
        "agent": str,
        "metadata": bytes,
        "mem": "DRAM",
        "base": int,
        "num_blocks": int,
        "block_len": int,
        "slices": [int, ...],
        "host": str,
        "cma": bool,
        "pid": int,
        "mark": int,
        "token": int,
    }

``metadata`` is NIXL's ``get_agent_metadata()`` taken after the region was registered (it
carries the remote keys); ``base`` is the region's virtual address in the owner's process.
``host`` (:func:`p2pkv_nixl.locality.host_id`, ``""`` if unknown) and ``cma`` (whether the
owner's UCX has its ``cma`` transport) let a reader decide whether its reads from this region
may land directly in its slots (see :mod:`p2pkv_nixl.locality`); ``pid``, ``mark`` and
``token`` name the owner's open mark, which such a reader checks after each read
(:mod:`p2pkv_nixl.open_mark`; absent or 0: none, and ``auto`` then stages). Version 2 is wire 2.0's
(consumer-posted reads; version 1 descriptors were for writes). Unknown extra keys are ignored
(a later minor version may add some); a different ``v`` is rejected. Decoding checks every
field's type and range and raises ``PeerRejected`` with the reason; nothing from the
descriptor reaches NIXL unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
from p2pkv.errors import PeerRejected

from p2pkv_nixl.slices import checked_slices

__all__ = ["FORMAT", "MAX_BLOCKS", "VERSION", "RegionDescriptor"]

FORMAT = "p2pkv-nixl"
VERSION = 3
MAX_BLOCKS = 2**31 - 1
"""NIXL takes block indexes as int32."""
_ADDRESS_LIMIT = 2**64


@dataclass(frozen=True)
class RegionDescriptor:
    agent: str
    metadata: bytes
    base: int
    num_blocks: int
    block_len: int
    host: str = ""
    """Host and PID namespace of the owner (``""``: unknown, never local)."""
    cma: bool = False
    """Whether the owner's UCX has its ``cma`` transport."""
    mem: str = "DRAM"
    slices: tuple[int, ...] = ()
    """Block counts of the region's registrations; ``()`` stands for one (the whole
    region) and is stored as ``(num_blocks,)``."""
    pid: int = 0
    """The owner's pid (in the PID namespace ``host`` names); 0: not given."""
    mark: int = 0
    """Address of the owner's open mark in its process; 0: none."""
    token: int = 0
    """What the open mark holds while its owner is open."""

    def __post_init__(self) -> None:
        if not self.slices:
            object.__setattr__(self, "slices", (self.num_blocks,))

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "format": FORMAT,
                "v": VERSION,
                "agent": self.agent,
                "metadata": self.metadata,
                "mem": self.mem,
                "base": self.base,
                "num_blocks": self.num_blocks,
                "block_len": self.block_len,
                "slices": list(self.slices),
                "host": self.host,
                "cma": self.cma,
                "pid": self.pid,
                "mark": self.mark,
                "token": self.token,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, data: bytes, peer_id: str) -> RegionDescriptor:
        """Parse and validate; ``PeerRejected`` names the peer and what is wrong."""

        def reject(reason: str) -> PeerRejected:
            return PeerRejected(f"peer {peer_id!r}: {reason}")

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise reject(f"nixl descriptor must be bytes, got {type(data).__name__}")
        try:
            fields: Any = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as exc:
            raise reject(f"malformed nixl descriptor ({type(exc).__name__}: {exc})") from None
        if not isinstance(fields, dict) or fields.get("format") != FORMAT:
            raise reject("not a p2pkv-nixl descriptor (is the peer using another data transport?)")
        if fields.get("v") != VERSION:
            raise reject(f"nixl descriptor version {fields.get('v')!r}; this side reads {VERSION}")
        agent, metadata, mem = fields.get("agent"), fields.get("metadata"), fields.get("mem")
        base, num_blocks, block_len = (
            fields.get("base"),
            fields.get("num_blocks"),
            fields.get("block_len"),
        )
        if not (isinstance(agent, str) and agent):
            raise reject(f"nixl descriptor has no agent name: {agent!r}")
        if not (isinstance(metadata, bytes) and metadata):
            raise reject("nixl descriptor has no agent metadata")
        if mem != "DRAM":
            raise reject(f"nixl descriptor memory kind {mem!r}; this transport handles DRAM only")
        if not (_is_int(num_blocks) and 0 < num_blocks <= MAX_BLOCKS):
            raise reject(f"nixl descriptor num_blocks {num_blocks!r} is not in 1..{MAX_BLOCKS}")
        if not (_is_int(block_len) and block_len > 0):
            raise reject(f"nixl descriptor block_len {block_len!r} is not a positive integer")
        if not (_is_int(base) and base > 0 and base + num_blocks * block_len <= _ADDRESS_LIMIT):
            raise reject(f"nixl descriptor base address {base!r} is not a valid region address")
        try:
            host, cma, slices = _placement(fields, num_blocks)
            pid, mark, token = _open_mark(fields)
        except ValueError as exc:
            raise reject(f"nixl descriptor {exc}") from None
        return cls(
            agent, metadata, base, num_blocks, block_len, host, cma, mem, slices, pid, mark, token
        )


def _placement(fields: dict[str, Any], num_blocks: int) -> tuple[str, bool, tuple[int, ...]]:
    """A descriptor's ``host``, ``cma`` and ``slices``; ``ValueError`` says what is wrong."""
    host, cma, slices = fields.get("host"), fields.get("cma"), fields.get("slices")
    if not isinstance(host, str):
        raise ValueError(f"host {host!r} is not a string")
    if not isinstance(cma, bool):
        raise ValueError(f"cma {cma!r} is not a bool")
    try:
        return host, cma, checked_slices(slices, num_blocks)
    except ValueError as exc:
        raise ValueError(f"slice list {exc}") from None


def _open_mark(fields: dict[str, Any]) -> tuple[int, int, int]:
    """A descriptor's ``pid``, ``mark`` and ``token`` (each absent: 0); ``ValueError`` says
    what is wrong."""
    pid, mark, token = (fields.get(key, 0) for key in ("pid", "mark", "token"))
    if not (_is_int(pid) and 0 <= pid < 2**31):
        raise ValueError(f"pid {pid!r} is not in 0..{2**31 - 1}")
    for key, value in (("mark", mark), ("token", token)):
        if not (_is_int(value) and 0 <= value < _ADDRESS_LIMIT):
            raise ValueError(f"{key} {value!r} is not a 64-bit unsigned integer")
    return pid, mark, token


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
