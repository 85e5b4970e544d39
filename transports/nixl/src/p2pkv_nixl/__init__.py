"""p2pkv-nixl: the ``nixl`` data transport for p2pkv (NIXL one-sided writes, UCX by default).

Importing this package does not import ``nixl``; the transport loads it when created.
"""

from __future__ import annotations

from p2pkv_nixl.transport import NixlDataTransport

__all__ = ["NixlDataTransport"]
__version__ = "0.1.0"
