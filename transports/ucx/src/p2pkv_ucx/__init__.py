"""p2pkv-ucx: the ``ucx`` data transport for p2pkv, over ucxx tag messaging in host memory.

Importing this package (or :mod:`p2pkv_ucx.plugin`) never imports ucxx; the transport loads
it when it is created and raises ``TransportUnavailable`` naming the lean install otherwise.
"""

from __future__ import annotations

__all__ = ["UcxDataTransport"]

from p2pkv_ucx.transport import UcxDataTransport
