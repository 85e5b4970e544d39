"""A parser for UCX's protocol-selection tables (the ``UCX_PROTO_INFO=y`` output).

Pure text processing, no UCX import: ``p2pkv doctor`` (p2pkv-tools) and ``p2pkv_nixl.ucx``
both read the lanes UCX chose through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneRow:
    """One row of a UCX protocol-selection table: for ``operation`` in ``size_range`` bytes,
    UCX uses ``protocol`` over ``lanes`` (e.g. ``cma/memory``, ``tcp/lo``)."""

    endpoint: str
    operation: str
    size_range: str
    protocol: str
    lanes: str


_TS = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")


def parse_proto_info(text: str) -> list[LaneRow]:
    """Parse ``UCX_PROTO_INFO=y`` output into rows (endpoints to self are left out).

    UCX prints one box per (endpoint configuration, operation), in one of two layouts: UCX
    1.23 (bundled with NIXL)::

        | A intra-node cfg#1                                   |
        | remote memory write by ucp_put* from host memory ... |
        | Range  | Description | Config     |
        | 0..inf | zero-copy   | cma/memory |

    and UCX 1.21 (shipped for ucxx)::

        | ctx intra-node cfg#0 | tagged message by ucp_tag_send* ... |
        |   0..8184 | eager short                                    | tcp/lo |
        | 16353..inf | (?) rendezvous fragmented copy-in copy-out    | tcp/lo |
    """
    rows: list[LaneRow] = []
    titles: list[str] = []
    endpoint = operation = ""
    for raw in text.splitlines():
        line = _TS.sub("", raw).strip()
        if line.startswith("+"):
            continue
        if not (line.startswith("|") and line.endswith("|")):
            titles, endpoint, operation = [], "", ""
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # a title line of the 1.23 layout
            if operation:
                titles, endpoint, operation = [], "", ""
            titles.append(cells[0])
        elif len(cells) == 2:  # the one-line title of the 1.21 layout
            titles, endpoint, operation = [], cells[0], cells[1]
        elif cells[0] == "Range" and len(titles) >= 2:
            endpoint, operation = titles[0], titles[1]
        elif endpoint and operation and len(cells) >= 3 and " self " not in f" {endpoint} ":
            rows.append(LaneRow(endpoint, operation, cells[0], cells[1], cells[2]))
    return rows
