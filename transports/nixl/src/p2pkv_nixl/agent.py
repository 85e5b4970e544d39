"""Setting up a NIXL agent over a block region (shared by the transport and the raw baseline).

Everything here runs once per transport, on the constructing thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from p2pkv.contracts import DataSettings
from p2pkv.errors import ConfigError

from p2pkv_nixl import library
from p2pkv_nixl.descriptor import MAX_BLOCKS, RegionDescriptor
from p2pkv_nixl.library import Nixl
from p2pkv_nixl.options import NixlOptions

__all__ = [
    "LOCAL",
    "LocalRegion",
    "block_dlist",
    "open_agent",
    "region_array",
    "register_region",
    "register_slices",
]

LOCAL = "NIXL_INIT_AGENT"
"""``prep_xfer_dlist`` name for a local (initiator-side) descriptor list."""


def region_array(settings: DataSettings) -> npt.NDArray[np.uint8]:
    """``settings.region`` as a flat uint8 array (sharing its memory); ``ConfigError`` if the
    region is not a writable, C-contiguous whole number of blocks."""
    region, block_len = settings.region, settings.block_len
    if not isinstance(region, memoryview):
        raise ConfigError(f"region must be a memoryview, got {type(region).__name__}")
    if region.readonly or not region.c_contiguous:
        raise ConfigError("region must be a writable, C-contiguous buffer")
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len <= 0:
        raise ConfigError(f"block_len must be a positive integer, got {block_len!r}")
    if region.nbytes == 0 or region.nbytes % block_len:
        raise ConfigError(
            f"region of {region.nbytes} bytes is not a positive multiple of block_len {block_len}"
        )
    if region.nbytes // block_len > MAX_BLOCKS:
        raise ConfigError(f"region has more than {MAX_BLOCKS} blocks (NIXL indexes are int32)")
    return np.frombuffer(region.cast("B"), dtype=np.uint8)


def block_dlist(base: int, slices: Sequence[int], block_len: int) -> npt.NDArray[np.uint64]:
    """The blocks of a region at ``base`` registered in ``slices`` (block counts), in NIXL's
    strided Nx5 form (address, length, device, stride, count): one row per slice, indexed
    per block across rows. A row never spans two registrations (NIXL refuses one that does,
    and merges contiguous indexes only within a row)."""
    rows = np.zeros((len(slices), 5), dtype=np.uint64)
    counts = np.asarray(slices, dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + (np.cumsum(counts) - counts) * np.uint64(block_len)
    rows[:, 1] = rows[:, 3] = block_len
    rows[:, 4] = counts
    return rows


def register_slices(agent: Any, base: int, slices: Sequence[int], block_len: int) -> Any:
    """Register the blocks at ``base`` as one NIXL registration per slice (DRAM), in one
    call; returns the registration list (deregistered as one). Raises what NIXL raises."""
    rows = block_dlist(base, slices, block_len)
    return agent.register_memory(
        [(int(a), int(n) * block_len, 0, "") for a, n in zip(rows[:, 0], slices, strict=True)],
        "DRAM",
    )


def open_agent(nixl: Nixl, options: NixlOptions) -> tuple[Any, str]:
    """A new agent named by a fresh uuid, with ``options.backends`` created.

    ``ConfigError`` if a backend is not available or fails to start (e.g. ``UCX_TLS=shm`` or
    ``cma`` alone: UCX finds no transport for active messages). Applies the UCX environment
    defaults first (UCX reads them when the backend starts)."""
    library.apply_ucx_defaults()
    name = f"p2pkv-{uuid.uuid4()}"
    config = nixl.config_cls(
        enable_prog_thread=options.enable_prog_thread,
        enable_listen_thread=False,
        backends=[],
    )
    try:
        agent = nixl.agent_cls(name, config)
    except Exception as exc:
        raise ConfigError(f"cannot create a NIXL agent: {type(exc).__name__}: {exc}") from exc
    available = list(agent.get_plugin_list())
    for backend in options.backends:
        if backend not in available:
            raise ConfigError(
                f"nixl data option 'backends': NIXL backend {backend!r} is not available here; "
                f"available: {', '.join(sorted(available))}"
            )
        try:
            agent.create_backend(backend, options.init_params(backend))
        except Exception as exc:
            raise ConfigError(
                f"NIXL backend {backend!r} failed to start ({type(exc).__name__}: {exc}); "
                f"check UCX_TLS (it needs an active-message transport such as tcp: 'shm' or "
                f"'cma' alone fail) and nixl data option 'backend_params'"
            ) from exc
    return agent, name


@dataclass(frozen=True)
class LocalRegion:
    """What registering a block region with an agent produced."""

    registrations: list[Any]
    """NIXL registrations: the region's (one per slice, as one list) first, then the extra
    buffers (deregister in reverse)."""
    dlist: Any
    """The region's prepared local descriptor list (one entry per block)."""
    descriptor: bytes
    """Our encoded :class:`RegionDescriptor`, for peers."""


def register_region(
    agent: Any,
    agent_name: str,
    array: npt.NDArray[np.uint8],
    block_len: int,
    extra: Sequence[npt.NDArray[np.uint8]] = (),
    *,
    slices: Sequence[int] = (),
    identity: Mapping[str, Any] | None = None,
) -> LocalRegion:
    """Register ``array`` in ``slices`` (block counts; ``()``: whole, one registration) and
    ``extra`` buffers as DRAM, prepare its block list and take the agent metadata (after
    registering: it carries the remote keys). ``slices`` and ``identity`` (the owner's
    placement and open mark: :class:`RegionDescriptor`'s ``host``, ``cma``, ``pid``, ``mark``,
    ``token``) go into the descriptor (see :mod:`p2pkv_nixl.slices`,
    :mod:`p2pkv_nixl.locality`, :mod:`p2pkv_nixl.open_mark`). ``ConfigError``
    on failure, with whatever was registered deregistered again."""
    base, num_blocks = int(array.ctypes.data), array.size // block_len
    slices = tuple(slices) or (num_blocks,)
    registrations: list[Any] = []
    try:
        registrations.append(register_slices(agent, base, slices, block_len))
        for buffer in extra:
            registrations.append(
                agent.register_memory([(int(buffer.ctypes.data), buffer.nbytes, 0, "")], "DRAM")
            )
        dlist = agent.prep_xfer_dlist(LOCAL, block_dlist(base, slices, block_len), "DRAM")
        metadata = agent.get_agent_metadata()
    except Exception as exc:
        for registration in reversed(registrations):
            try:
                agent.deregister_memory(registration)
            except Exception:
                pass  # already failing; the agent goes with this transport
        raise ConfigError(
            f"NIXL could not register the region: {type(exc).__name__}: {exc}"
        ) from exc
    descriptor = RegionDescriptor(
        agent_name, metadata, base, num_blocks, block_len, slices=slices, **(identity or {})
    ).encode()
    return LocalRegion(registrations, dlist, descriptor)
