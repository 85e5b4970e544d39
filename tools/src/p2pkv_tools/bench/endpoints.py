"""Data-plane endpoints the bench drives: p2pkv transports, raw-library baselines, memcpy.

Every series of the matrix is an *endpoint kind* built over a caller-owned region:

- ``p2pkv``: a registered ``DataTransport`` (``nixl``, ``ucx``, ``memory`` ...), built exactly
  as the tier builds it (registry + ``DataSettings`` with its ``data_options``), over a region
  from its own ``allocate_region`` (:mod:`p2pkv_tools.bench.data_transport`).
- ``raw``: a baseline from a transport distribution (hook ``p2pkv_bench_baselines``): the same
  library driven without p2pkv (e.g. NIXL with the same prepared descriptors). Baselines are
  duck-typed like ``DataTransport`` — ``create(DataSettings)``, ``descriptor()``,
  ``add_peer(peer, descriptor)``, ``read_blocks(peer, local, remote) -> id``,
  ``poll(peer) -> PollResult``, ``progress()``, ``close()`` — so the bench times both with
  one loop. A baseline class may name further baselines of its library in ``variants``
  (variant -> class, the same interface): each is a series of its own, ``raw <name>
  <variant>`` (e.g. ``raw nixl write``: the source WRITEs what the reader asks for), run in
  the same process as the baseline.

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

__all__ = ["SeriesSpec", "baseline_variants", "make_endpoint", "raw_baseline"]


@dataclass(frozen=True)
class SeriesSpec:
    """One series of the matrix: what moves the bytes.

    ``impl`` is ``p2pkv``, ``raw`` or ``memcpy``; ``transport`` names the transport (or the
    library for ``raw``; ``memcpy`` for memcpy); ``variant`` names one of a raw baseline's
    ``variants`` ("" for the baseline itself).
    """

    impl: str
    transport: str
    cross_process: bool
    variant: str = ""

    @property
    def label(self) -> str:
        """``memcpy``, ``<impl> <transport>`` or ``raw <transport> <variant>``."""
        if self.impl == "memcpy":
            return "memcpy"
        return " ".join(part for part in (self.impl, self.transport, self.variant) if part)


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
        baseline = raw_baseline(registry, spec)
        if not callable(getattr(baseline, "read_blocks", None)):
            raise ConfigError(
                f"raw baseline {spec.label!r} has no read_blocks(peer, local, remote): "
                "it predates wire 2.0 (the bench reads from the target's region)"
            )
        return baseline.create(settings)
    raise ConfigError(f"series {spec.label!r} has no endpoint")


def baseline_variants(baseline: type[Any]) -> dict[str, type[Any]]:
    """A raw baseline's ``variants`` (variant name -> class); {} when it declares none."""
    return dict(getattr(baseline, "variants", None) or {})


def raw_baseline(registry: Registry, spec: SeriesSpec) -> type[Any]:
    """The class of raw series ``spec``: the baseline named ``spec.transport``, or its
    variant ``spec.variant``; ``ConfigError`` naming what is installed when there is none."""
    baselines = registry.bench_baselines()
    baseline = baselines.get(spec.transport)
    if baseline is None:
        raise ConfigError(
            f"no raw baseline named {spec.transport!r}; installed: "
            f"{', '.join(sorted(baselines)) or 'none'}"
        )
    if not spec.variant:
        return baseline
    variants = baseline_variants(baseline)
    if spec.variant not in variants:
        raise ConfigError(
            f"raw baseline {spec.transport!r} has no variant {spec.variant!r}; it has: "
            f"{', '.join(sorted(variants)) or 'none'}"
        )
    return variants[spec.variant]
