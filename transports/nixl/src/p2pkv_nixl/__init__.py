"""p2pkv-nixl: the ``nixl`` data transport for p2pkv (NIXL reads and writes, UCX by default).

The consumer posts every read (wire 2.0). Reads from a same-host peer over UCX's ``cma`` land
directly in the slots; all others go through a staging pool, so a cancelled read never lands
(:mod:`p2pkv_nixl.transport`, :mod:`p2pkv_nixl.staging`).

``data_options`` (:mod:`p2pkv_nixl.options` validates them; unknown keys are a
``ConfigError`` naming the key): ``backends`` (``["UCX"]``), ``num_threads`` (0),
``enable_prog_thread`` (false), ``drain_timeout`` (5.0 s), ``backend_params`` ({}),
``warmup`` (true), ``staging`` (``"auto"`` | ``"always"`` | ``"never"``; ``never`` leaves
finality on non-``cma`` lanes to the operator) and ``staging_blocks`` (256, capped at the
region's block count).

Importing this package does not import ``nixl``; the transport loads it when created.
"""

from __future__ import annotations

from p2pkv_nixl.transport import NixlDataTransport

__all__ = ["NixlDataTransport"]
__version__ = "0.1.0"
