"""Block index lists as NIXL takes them (contiguous int32), checked on ``read_blocks``' hot path.

Every check raises ``ValueError`` saying which index is wrong; the caller names the side
(``local block ...``, ``remote (peer 'p') block ...``) and turns it into
``TransferSubmitError``.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["checked_indexes", "refuse_repeats"]

_SMALL = 64
"""Up to this many indexes, Python's C builtins (min, max, set) beat numpy's per-call cost."""


def checked_indexes(idxs: Sequence[int], limit: int) -> npt.NDArray[np.int32]:
    """``idxs`` as a contiguous int32 array with every index in ``0..limit-1``, else
    ``ValueError`` saying which index is wrong.

    A list (of ``int`` or numpy integers) goes through ``array.array("i")``: C speed,
    straight to int32, and it refuses floats, strings and nested lists (``np.asarray`` with
    an int dtype would silently truncate or parse them). An ndarray must be 1-D with an
    integer dtype. At most one numpy reduction, none for short lists.
    """
    if isinstance(idxs, np.ndarray):
        if idxs.ndim != 1 or (idxs.size and idxs.dtype.kind not in "iu"):
            raise ValueError("indexes must be a flat list of integers")
        wide = idxs.astype(np.int64, copy=False)
        if wide.size and int(wide.view(np.uint64).max()) >= limit:  # negatives wrap high
            _raise_outside(wide.tolist(), limit)
        return np.ascontiguousarray(wide, dtype=np.int32)
    try:
        packed = array.array("i", idxs)
    except OverflowError:
        raise ValueError(f"index outside 0..{limit - 1} (beyond int32)") from None
    except (TypeError, ValueError):
        raise ValueError("indexes must be a flat list of integers") from None
    if len(packed) <= _SMALL:
        if packed and (min(packed) < 0 or max(packed) >= limit):
            _raise_outside(packed, limit)
    elif int(np.frombuffer(packed, dtype=np.uint32).max()) >= limit:  # negatives wrap high
        _raise_outside(packed, limit)
    return np.frombuffer(packed, dtype=np.int32)


def _raise_outside(values: Iterable[int], limit: int) -> None:
    bad = next(v for v in values if not 0 <= v < limit)
    raise ValueError(f"index {bad} is outside 0..{limit - 1}")


def refuse_repeats(checked: npt.NDArray[np.int32], given: Sequence[int]) -> None:
    """``ValueError`` if one block appears twice in ``checked`` (``given`` is the caller's
    list it came from: short plain lists are checked with a set). Used on destinations: the
    bytes landing in a block named twice would depend on the backend's order."""
    if len(checked) <= _SMALL:
        values = given if isinstance(given, (list, tuple)) else checked.tolist()
        if len(set(values)) == len(values):
            return
    else:
        ordered = np.sort(checked)
        if not (ordered[1:] == ordered[:-1]).any():
            return
    seen: set[int] = set()
    for value in checked.tolist():
        if value in seen:
            raise ValueError(f"index {value} appears twice in one read")
        seen.add(value)
