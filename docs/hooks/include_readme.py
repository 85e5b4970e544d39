"""mkdocs hook: ``<!-- include: path/README.md -->`` inlines a distribution's README.

Each transport and plugin documents itself in its own README (what PyPI shows); the docs site
includes those files instead of copying them. Headings move one level down so the README's
title nests under the page, and links that point outside the docs (relative paths into the
repository) become plain text, since the site cannot serve them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r"<!--\s*include:\s*(\S+)\s*-->")
HEADING = re.compile(r"^(#{1,5}) ", re.M)
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?!https?://|#)[^)]+\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _demote(text: str) -> str:
    # Only outside code fences: a "# comment" in a shell block is not a heading.
    out, last = [], 0
    for m in FENCE.finditer(text):
        out.append(HEADING.sub(r"#\1 ", text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(HEADING.sub(r"#\1 ", text[last:]))
    return "".join(out)


def render_include(rel_path: str) -> str:
    text = (ROOT / rel_path).read_text()
    return RELATIVE_LINK.sub(r"\1", _demote(text))


def on_page_markdown(markdown: str, **_: Any) -> str:
    return INCLUDE.sub(lambda m: render_include(m.group(1)), markdown)
