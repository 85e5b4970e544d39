"""The pieces of the ``DataTransport`` base a backend meets: the read check, read states, and
what a peer record must tell the base.

:func:`check_read` is *the* index rule of ``DataTransport.read_blocks``; the base applies it
before a backend sees a read, and a transport that overrides ``read_blocks`` calls it itself.
It allocates only the index arrays it returns (no per-block Python objects); two lists of
ints, the usual read, become one numpy array in one call. A read of a few blocks (a single
block's pull) is checked in plain Python first: numpy's calls cost more than the check then.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from p2pkv.errors import ConfigError, TransferSubmitError

Indexes = npt.NDArray[np.int64]
"""Block indexes as the base hands them to a backend: a 1-D int64 array of its own."""

_SMALL = 64
"""Up to this many indexes a ``set`` finds repeats faster than a sort."""
_FEW = 8
"""Up to this many plain ``int`` indexes per list are checked in Python (:func:`_few_at_once`)."""
_BOOLS = (bool, np.bool_)
_FRESH = (list, tuple)
"""Index containers ``np.asarray`` always copies into a new array."""


class ReadState(enum.Enum):
    """Where a posted read stands, as a backend reports it to the base."""

    PENDING = "pending"
    DONE = "done"
    """Every byte of the read is in our blocks."""
    FAILED = "failed"


class AttachedPeer(Protocol):
    """What the base needs from a backend's peer record: the size of the peer's region."""

    @property
    def num_blocks(self) -> int: ...


def check_read(
    local_idxs: Sequence[int],
    remote_idxs: Sequence[int],
    num_blocks: int,
    peer_num_blocks: int,
    peer_id: str = "",
) -> tuple[Indexes, Indexes]:
    """Both index lists of a read, checked, as fresh int64 arrays ``(local, remote)``.

    The rule: equal lengths, not empty, each a flat sequence of integers (``int``, numpy
    integers, or a 1-D integer array; not bools, floats or nested lists), every local index
    within ``0..num_blocks-1`` and none twice (two sources for one slot), every remote index
    within ``0..peer_num_blocks-1``. A remote index may repeat (one source block may fill two
    slots). Raises ``TransferSubmitError`` naming the side and the offending index.
    """
    few = _few_at_once(local_idxs, remote_idxs, num_blocks, peer_num_blocks)
    if few is not None:
        return few
    both = _lists_at_once(local_idxs, remote_idxs)
    if both is not None:  # the usual read: two lists of ints, one numpy call
        highest = both.view(np.uint64).max(axis=1).tolist()  # negatives wrap above any limit
        if highest[0] >= num_blocks:
            _within(both[0], num_blocks, "local", "")
        if highest[1] >= peer_num_blocks:
            _within(both[1], peer_num_blocks, "remote", peer_id)
        _distinct(both[0])
        return both[0], both[1]
    local = _indexes(local_idxs, "local", "")
    remote = _indexes(remote_idxs, "remote", peer_id)
    if len(local) != len(remote):
        raise TransferSubmitError(f"{len(local)} local but {len(remote)} remote block indexes")
    if len(local) == 0:
        raise TransferSubmitError("the block indexes are empty: a read names at least one block")
    _within(local, num_blocks, "local", "")
    _within(remote, peer_num_blocks, "remote", peer_id)
    _distinct(local)
    return local, remote


def region_blocks(region: object, block_len: object) -> npt.NDArray[np.uint8]:
    """``region`` as a writable ``(num_blocks, block_len)`` uint8 view, or ``ConfigError``
    saying what is wrong (not a memoryview, read-only, not C-contiguous, not a positive
    multiple of ``block_len``, ``block_len`` not a positive int)."""
    if not isinstance(region, memoryview):
        raise ConfigError(f"region must be a memoryview, got {type(region).__name__}")
    if region.readonly or not region.c_contiguous:
        raise ConfigError("region must be a writable, C-contiguous buffer")
    if not isinstance(block_len, int) or isinstance(block_len, bool) or block_len <= 0:
        raise ConfigError(f"block_len must be a positive integer, got {block_len!r}")
    if region.nbytes == 0 or region.nbytes % block_len:
        raise ConfigError(
            f"region of {region.nbytes} bytes is not a positive multiple of block_len {block_len}"
        )
    return np.frombuffer(region.cast("B"), dtype=np.uint8).reshape(-1, block_len)


def allocated_region(
    cls: Any, num_blocks: int, block_len: int, options: Mapping[str, Any]
) -> memoryview:
    """``cls.allocate_region(num_blocks, block_len, options)`` (``cls``: a ``DataTransport``
    class), checked: ``ConfigError`` naming the class unless it is a writable memoryview of
    ``num_blocks * block_len`` bytes. Everything that asks a transport for a region (the kit,
    ``demo``, ``bench``) takes it through here."""
    region = cls.allocate_region(num_blocks, block_len, options)
    nbytes = num_blocks * block_len
    if not isinstance(region, memoryview) or region.nbytes != nbytes or region.readonly:
        raise ConfigError(
            f"{cls.__name__}.allocate_region({num_blocks}, {block_len}) must "
            f"return a writable memoryview of {nbytes} bytes, got {region!r}"
        )
    return region


def _side(what: str, peer_id: str) -> str:
    """The side an error names: ``what``, and the peer if known (built only for errors)."""
    return f"{what} (peer {peer_id!r})" if peer_id else what


def _few_at_once(
    local: Sequence[int], remote: Sequence[int], num_blocks: int, peer_num_blocks: int
) -> tuple[Indexes, Indexes] | None:
    """Two lists of at most :data:`_FEW` plain ints that pass the rule, as fresh int64 arrays;
    None for anything else, which the numpy path then checks (it raises what is wrong)."""
    if type(local) is not list or type(remote) is not list:
        return None
    count = len(local)
    if not 0 < count <= _FEW or len(remote) != count:
        return None
    for index in local:
        if type(index) is not int or not 0 <= index < num_blocks:
            return None
    for index in remote:
        if type(index) is not int or not 0 <= index < peer_num_blocks:
            return None
    if count > 1 and len(set(local)) != count:
        return None
    return np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64)


def _lists_at_once(local: Sequence[int], remote: Sequence[int]) -> Indexes | None:
    """Two non-empty lists of ints of one length as one fresh ``(2, n)`` int64 array, built
    by one numpy call; None for anything else (the general path checks it, with the same
    outcome). A list that starts with a bool (Python's or numpy's) goes the general path,
    which refuses it when it is all bools: inference over both lists would hide that."""
    if type(local) is not list or type(remote) is not list:
        return None
    if not local or len(local) != len(remote):
        return None
    if isinstance(local[0], _BOOLS) or isinstance(remote[0], _BOOLS):
        return None
    try:
        both: Indexes = np.asarray((local, remote))
    except ValueError:  # ragged: a nested list
        return None
    return both if both.ndim == 2 and both.dtype == np.int64 else None


def _indexes(idxs: Sequence[int], what: str, peer_id: str) -> Indexes:
    try:
        arr = np.asarray(idxs)
    except ValueError:  # ragged: numbers beside lists
        arr = np.empty((0, 0))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TransferSubmitError(
            f"{_side(what, peer_id)} block indexes must be a flat sequence of integers"
        )
    if arr.dtype == np.int64 and type(idxs) in _FRESH:
        return arr  # numpy built it from the list: already ours
    return arr.astype(np.int64)  # a copy: the caller may reuse its array


def _within(arr: Indexes, limit: int, what: str, peer_id: str) -> None:
    if int(arr.view(np.uint64).max()) < limit:  # negatives wrap above any limit
        return
    bad = int(arr[(arr < 0) | (arr >= limit)][0])
    raise TransferSubmitError(f"{_side(what, peer_id)} block index {bad} is outside 0..{limit - 1}")


def _distinct(local: Indexes) -> None:
    if len(local) <= _SMALL:
        values = local.tolist()
        if len(set(values)) == len(values):
            return
    else:
        ordered = np.sort(local)
        if not (ordered[1:] == ordered[:-1]).any():
            return
        values = local.tolist()
    seen: set[int] = set()
    for value in values:
        if value in seen:
            raise TransferSubmitError(f"local block index {value} is named twice in one read")
        seen.add(value)
