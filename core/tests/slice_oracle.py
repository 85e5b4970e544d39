"""The test oracle of slice boundaries, shared by core's, nixl's and ucx's slice tests (on the
pytest ``pythonpath``): computed from the definition, not with :mod:`p2pkv.runs`."""

from __future__ import annotations


def cuts(start: int, length: int, every: int) -> set[int]:
    """Offsets inside a run of ``length`` blocks from ``start`` where a slice of ``every``
    blocks begins."""
    return {o for o in range(1, length) if (start + o) % every == 0}
