"""The names of CURVE key files (pure Python: importing this module never imports zmq).

``NAME.key`` holds a public key (give it to peers), ``NAME.key_secret`` both halves (keep it
private). In a fleet key directory (``$P2PKV_CURVE_DIR``) the listeners' pair is ``server``
and the dialers' pair ``client``.
"""

from __future__ import annotations

__all__ = ["FLEET_CLIENT", "FLEET_SERVER", "PUBLIC_SUFFIX", "SECRET_SUFFIX"]

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
FLEET_SERVER = "server"
"""Name (``NAME.key``/``NAME.key_secret``) of the listeners' pair in a fleet key directory."""
FLEET_CLIENT = "client"
"""Name of the dialers' pair in a fleet key directory."""
