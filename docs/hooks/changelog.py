"""Changelog fragments: one file per change under ``docs/changes/``, rendered into the changelog.

A fragment is named ``<issue>.<slug>.<category>.md``: the issue number, a slug of lower-case
words joined by ``-``, and one of :data:`CATEGORIES` (Keep a Changelog's). It holds a few short
sentences of Markdown. Nobody edits ``docs/changelog.md`` by hand for a change any more.

- As a mkdocs hook, it renders the fragments at :data:`MARKER` in ``docs/changelog.md``, as
  the "Unreleased" section, by category.
- ``python docs/hooks/changelog.py check`` refuses a badly named or empty fragment: one line
  per fragment, exit 1 (``tests/test_changelog.py`` runs the same check in CI).
- ``python docs/hooks/changelog.py release VERSION [--date YYYY-MM-DD]`` writes the fragments
  into ``docs/changelog.md`` as VERSION's section (merged into it when it exists) and deletes
  them (``git rm`` follows in the release commit).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHANGES = ROOT / "docs" / "changes"
CHANGELOG = ROOT / "docs" / "changelog.md"
MARKER = "<!-- changelog-fragments -->"
CATEGORIES = ("added", "changed", "deprecated", "removed", "fixed", "security")
"""Keep a Changelog's categories, in the order a section lists them."""
NAME = re.compile(
    r"(?P<issue>[1-9][0-9]*)\.(?P<slug>[a-z0-9]+(?:-[a-z0-9]+)*)"
    r"\.(?P<category>[a-z]+)\.md"
)
IGNORED = {"README.md"}
"""Files in ``docs/changes/`` that are not fragments."""


@dataclass(frozen=True, order=True)
class Fragment:
    issue: int
    slug: str
    category: str
    text: str

    def bullet(self) -> str:
        """The fragment as one list item, its issue named at the end."""
        lines = self.text.strip().splitlines()
        body = "\n".join([f"- {lines[0]}", *(f"  {line}" if line else "" for line in lines[1:])])
        return f"{body} (issue {self.issue})"


def problems(directory: Path | None = None) -> list[str]:
    """Why each file of ``directory`` (``docs/changes``) is not a valid fragment, one line
    each."""
    directory = directory or CHANGES
    found = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if path.name in IGNORED:
            continue
        m = NAME.fullmatch(path.name)
        if m is None:
            found.append(
                f"{path.name}: not <issue>.<slug>.<category>.md (issue a number, slug "
                f"lower-case words joined by '-')"
            )
        elif m["category"] not in CATEGORIES:
            found.append(
                f"{path.name}: category {m['category']!r} is not one of {', '.join(CATEGORIES)}"
            )
        elif not path.is_file() or not path.read_text().strip():
            found.append(f"{path.name}: empty (write a few short sentences)")
        elif path.read_text().lstrip().startswith("#"):
            found.append(f"{path.name}: starts with a heading (the category is the heading)")
    return found


def fragments(directory: Path | None = None) -> list[Fragment]:
    """The valid fragments of ``directory`` (``docs/changes``), by issue and slug (invalid
    ones left out)."""
    directory = directory or CHANGES
    out = []
    for path in sorted(directory.glob("*.md")) if directory.is_dir() else []:
        m = NAME.fullmatch(path.name)
        if m and m["category"] in CATEGORIES and path.read_text().strip():
            out.append(Fragment(int(m["issue"]), m["slug"], m["category"], path.read_text()))
    return sorted(out)


def by_category(items: Iterable[Fragment]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for item in items:
        grouped.setdefault(item.category, []).append(item.bullet())
    return grouped


def render_section(title: str, grouped: dict[str, list[str]]) -> str:
    """A ``## title`` section with one ``###`` subsection per category, in order."""
    parts = [f"## {title}"]
    for category in CATEGORIES:
        if grouped.get(category):
            parts += [f"### {category.capitalize()}", "\n".join(grouped[category])]
    if len(parts) == 1:
        parts.append("Nothing yet.")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: the fragments, rendered as the Unreleased section at the marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_section("Unreleased", by_category(fragments())))


def release(
    version: str, date: str, changelog: Path = CHANGELOG, directory: Path = CHANGES
) -> list[Path]:
    """Write the fragments into ``changelog`` as ``version``'s section; returns the fragment
    files, deleted. An existing ``## version`` section gets the new items first in each
    category."""
    items = fragments(directory)
    text = changelog.read_text()
    grouped = by_category(items)
    heading = re.compile(rf"^## {re.escape(version)}\b.*$", re.M)
    m = heading.search(text)
    if m is None:
        section = render_section(f"{version} ({date})", grouped)
        text = text.replace(MARKER, f"{MARKER}\n\n{section}", 1)
    else:
        end = re.compile(r"^## ", re.M).search(text, m.end())
        stop = end.start() if end else len(text)
        text = text[: m.start()] + _merged(text[m.start() : stop], grouped) + text[stop:]
    changelog.write_text(text)
    paths = [directory / f"{i.issue}.{i.slug}.{i.category}.md" for i in items]
    for path in paths:
        path.unlink()
    return paths


def _merged(section: str, grouped: dict[str, list[str]]) -> str:
    """``section`` with each category's new items first in its subsection (made if absent,
    in Keep a Changelog's order)."""
    for category in CATEGORIES:
        new = grouped.get(category)
        if not new:
            continue
        title = f"### {category.capitalize()}\n\n"
        if title in section:
            section = section.replace(title, title + "\n".join(new) + "\n", 1)
            continue
        later = [f"### {c.capitalize()}\n" for c in CATEGORIES[CATEGORIES.index(category) + 1 :]]
        at = min(
            (section.index(t) for t in later if t in section), default=len(section.rstrip("\n")) + 1
        )
        block = title + "\n".join(new) + "\n\n"
        section = section[:at] + block + section[at:]
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="refuse badly named or empty fragments")
    rel = sub.add_parser("release", help="write the fragments into the changelog")
    rel.add_argument("version")
    rel.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args(argv)
    if args.command == "check":
        found = problems()
        for line in found:
            print(f"docs/changes/{line}", file=sys.stderr)
        return 1 if found else 0
    bad = problems()
    if bad:
        print("fix the fragments first: " + "; ".join(bad), file=sys.stderr)
        return 2
    done = release(args.version, args.date)
    print(f"{len(done)} fragment(s) written into {CHANGELOG.relative_to(ROOT)} and deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
