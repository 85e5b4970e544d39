"""Data-plane endpoints the bench drives: p2pkv transports, raw-library baselines, memcpy.

Every series of the matrix is an *endpoint kind* built over a caller-owned region:

- ``p2pkv``: a registered ``DataTransport`` (``nixl``, ``ucx``, ``memory`` ...), built exactly
  as the tier builds it (registry + ``DataSettings`` with its ``data_options``), over a region
  from its own ``allocate_region`` (:mod:`p2pkv.bench.data_transport`).
- ``raw``: a baseline from a transport distribution (hook ``p2pkv_bench_baselines``): the same
  library driven without p2pkv (e.g. NIXL with the same prepared descriptors). Baselines are
  duck-typed like ``DataTransport`` — ``create(DataSettings)``, ``descriptor()``,
  ``add_peer(peer, descriptor)``, ``read_blocks(peer, local, remote) -> id``,
  ``poll(peer) -> PollResult``, ``progress()``, ``close()`` — so the bench times both with
  one loop.

Two endpoints of a kind are paired (wire 2.0: the consumer owns every write into its region):
the initiator reads blocks of the target's region into its own slots; the target only
progresses (``progress()``/``poll()``), serving those reads when its transport is two-sided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv.contracts import DataSettings
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry

__all__ = ["SeriesSpec", "make_endpoint"]


@dataclass(frozen=True)
class SeriesSpec:
    """One series of the matrix: what moves the bytes.

    ``impl`` is ``p2pkv``, ``raw`` or ``memcpy``; ``transport`` names the transport (or the
    library for ``raw``; ``memcpy`` for memcpy).
    """

    impl: str
    transport: str
    cross_process: bool

    @property
    def label(self) -> str:
        return "memcpy" if self.impl == "memcpy" else f"{self.impl} {self.transport}"


def make_endpoint(
    spec: SeriesSpec,
    registry: Registry,
    region: memoryview,
    block_len: int,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """Build the endpoint of ``spec`` over ``region``; a p2pkv transport gets ``options``
    (its ``data_options``), a raw baseline none.

    Raises ``ConfigError`` for an unknown series or a raw baseline without ``read_blocks``,
    and the transport's ``TransportUnavailable`` when it cannot run here."""
    settings = DataSettings(region=region, block_len=block_len, options={})
    if spec.impl == "p2pkv":
        cls = registry.transport("data", spec.transport)
        problem = cls.availability()
        if problem is not None:
            raise problem
        return cls.create(DataSettings(region, block_len, dict(options or {})))
    if spec.impl == "raw":
        baseline = registry.bench_baselines().get(spec.transport)
        if baseline is None:
            raise ConfigError(
                f"no raw baseline named {spec.transport!r}; installed: "
                f"{', '.join(sorted(registry.bench_baselines())) or 'none'}"
            )
        if not callable(getattr(baseline, "read_blocks", None)):
            raise ConfigError(
                f"raw baseline {spec.transport!r} has no read_blocks(peer, local, remote): "
                "it predates wire 2.0 (the bench reads from the target's region)"
            )
        return baseline.create(settings)
    raise ConfigError(f"series {spec.label!r} has no endpoint")
