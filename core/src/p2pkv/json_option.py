"""One JSON object from a command-line option: the text itself, or ``@file`` holding it.

Used by ``p2pkv doctor --config`` and ``p2pkv check-config --kv-transfer-config``, so both
read and refuse their input the same way: a ``ConfigError`` naming the option, and the file
when it cannot be read, never a traceback.
"""

from __future__ import annotations

import json
from typing import Any

from p2pkv.errors import ConfigError


def option_text(text: str, option: str) -> str:
    """``text`` itself, or the content of the file ``@path`` names (``ConfigError`` naming
    the option and the file when it cannot be read)."""
    if not text.startswith("@"):
        return text
    try:
        with open(text[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(
            f"{option} {text}: cannot read {text[1:]!r}: {exc.strerror or exc}"
        ) from exc


def json_object(text: str, option: str, what: str) -> dict[str, Any]:
    """Parse ``text`` (or the file ``@path`` names) as a JSON object; ``what`` names what the
    object must be in the error ("a tier config", "vLLM's KVTransferConfig")."""
    text = option_text(text, option)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} is not valid JSON: {exc}") from exc
    except ValueError:  # an integer beyond Python's digit limit (4300 digits)
        raise ConfigError(
            f"{option} holds an integer of thousands of digits: no setting takes such a number"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{option} must be a JSON object ({what})")
    return raw
