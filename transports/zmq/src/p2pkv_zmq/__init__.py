"""ZeroMQ control transport for p2pkv (``control: zmq``).

Registered through the ``p2pkv`` entry-point group by :mod:`p2pkv_zmq.plugin`. Importing this
package never imports zmq; :meth:`ZmqControlTransport.create` does. Options: see
:mod:`p2pkv_zmq.options` and the README.
"""

from __future__ import annotations

from p2pkv_zmq.transport import ZmqControlTransport

__all__ = ["ZmqControlTransport", "__version__"]

__version__ = "0.1.0"
