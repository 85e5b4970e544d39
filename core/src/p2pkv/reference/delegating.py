"""Wrappers that forward the whole transport contract to an inner transport.

:class:`DelegatingControlTransport` and :class:`DelegatingDataTransport` forward every
member of their contract, optional ones included (``take_active``/``batch_sends``/``flush``/
``interrupt``/``forget_dial_failure``/``silence_timeout``;
``read_capacity``/``descriptors_posted``/``held``), to ``inner``, and report its
capabilities. A wrapper that injects faults or records calls subclasses one, overrides
only the calls it changes and calls ``super()`` for the rest, so a member added to a
contract is forwarded in one place.

Ownership: a wrapper owns its inner transport (its ``close`` closes it). Threading: as the
inner transport's (the driver thread; ``interrupt`` from any thread).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar, NoReturn

from p2pkv.contracts import (
    ControlConnection,
    ControlSettings,
    ControlTransport,
    DataSettings,
    DataTransport,
    PollResult,
    SessionRoom,
)
from p2pkv.data_base import AttachedPeer

__all__ = ["DelegatingControlTransport", "DelegatingDataTransport"]


class DelegatingControlTransport(ControlTransport):
    """A control transport that forwards every call to ``inner`` (build it around an
    instance; ``create`` refuses)."""

    name: ClassVar[str] = "delegating"

    def __init__(self, inner: ControlTransport) -> None:
        self.inner = inner
        vars(self)["capabilities"] = inner.capabilities

    @classmethod
    def create(cls, settings: ControlSettings) -> ControlTransport:
        raise TypeError(f"{cls.__name__} wraps a transport instance: build the inner one first")

    @property
    def local_address(self) -> str:
        return self.inner.local_address

    def connect(self, address: str) -> ControlConnection:
        return self.inner.connect(address)

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        return self.inner.poll(timeout)

    def close(self) -> None:
        self.inner.close()

    def take_active(self) -> Collection[ControlConnection] | None:
        return self.inner.take_active()

    def batch_sends(self) -> bool:
        return self.inner.batch_sends()

    def flush(self) -> None:
        self.inner.flush()

    def interrupt(self) -> None:
        self.inner.interrupt()

    def forget_dial_failure(self, address: str) -> None:
        self.inner.forget_dial_failure(address)

    def session_room(self) -> SessionRoom | None:
        return self.inner.session_room()

    @property
    def accepts_refused(self) -> int:
        return self.inner.accepts_refused

    @property
    def silence_timeout(self) -> float | None:
        return self.inner.silence_timeout


class DelegatingDataTransport(DataTransport):
    """A data transport that forwards every call to ``inner`` (build it around an instance;
    ``create`` refuses). The inner transport holds the region and the peers; this one holds
    nothing of its own."""

    name: ClassVar[str] = "delegating"

    def __init__(self, inner: DataTransport) -> None:
        self.inner = inner
        vars(self)["capabilities"] = inner.capabilities

    @classmethod
    def create(cls, settings: DataSettings) -> NoReturn:
        raise TypeError(f"{cls.__name__} wraps a transport instance: build the inner one first")

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def block_len(self) -> int:
        return self.inner.block_len

    @property
    def descriptors_posted(self) -> int | None:
        """The inner transport's count (read and written through)."""
        return self.inner.descriptors_posted

    @descriptors_posted.setter
    def descriptors_posted(self, value: int | None) -> None:
        self.inner.descriptors_posted = value

    def descriptor(self) -> bytes:
        return self.inner.descriptor()

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self.inner.add_peer(peer_id, descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        return self.inner.remove_peer(peer_id)

    def attached_peer(self, peer_id: str) -> AttachedPeer | None:
        return self.inner.attached_peer(peer_id)

    def read_handle(self, transfer_id: int) -> Any:
        return self.inner.read_handle(transfer_id)

    def read_capacity(self, peer_id: str) -> int | None:
        return self.inner.read_capacity(peer_id)

    def held(self) -> dict[str, int]:
        return self.inner.held()

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        return self.inner.read_blocks(peer_id, local_idxs, remote_idxs)

    def progress(self) -> None:
        self.inner.progress()

    def poll(self, peer_id: str | None = None) -> PollResult:
        return self.inner.poll(peer_id)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        self.inner.cancel(transfer_ids)

    def close(self) -> list[int]:
        return self.inner.close()
