"""Changelog fragments (``docs/changes/``) are well named, and render into the changelog.

The rules and the renderer are ``docs/hooks/changelog.py``; this is the CI check that
refuses a badly named fragment, as zarr-python's ``check_changelogs`` workflow does.
"""

from __future__ import annotations

import re
from pathlib import Path

import changelog
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_fragment_in_the_tree_is_well_named() -> None:
    assert changelog.problems() == []


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("49.public-api.changed.md", ""),
        ("49.public-api.addded.md", "category 'addded' is not one of"),
        ("49.public_api.added.md", "not <issue>.<slug>.<category>.md"),
        ("public-api.added.md", "not <issue>.<slug>.<category>.md"),
        ("49.Public-API.added.md", "not <issue>.<slug>.<category>.md"),
        ("49.public-api.added.txt", "not <issue>.<slug>.<category>.md"),
        ("049.public-api.added.md", "not <issue>.<slug>.<category>.md"),
    ],
)
def test_a_badly_named_fragment_is_refused_naming_the_rule(
    tmp_path: Path, name: str, fragment: str
) -> None:
    (tmp_path / name).write_text("One short sentence.\n")
    found = changelog.problems(tmp_path)
    if not fragment:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(name) and fragment in found[0]


@pytest.mark.parametrize(
    "text, fragment",
    [("", "empty"), ("  \n", "empty"), ("# Added\n\nx\n", "starts with a heading")],
)
def test_an_empty_or_headed_fragment_is_refused(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "49.x.added.md").write_text(text)
    (found,) = changelog.problems(tmp_path)
    assert fragment in found


def test_the_check_command_fails_on_a_bad_fragment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "49.x.improved.md").write_text("x\n")
    monkeypatch.setattr(changelog, "CHANGES", tmp_path)
    assert changelog.main(["check"]) == 1
    assert "docs/changes/49.x.improved.md: category 'improved'" in capsys.readouterr().err


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    changes = tmp_path / "changes"
    changes.mkdir()
    (changes / "49.zeta.fixed.md").write_text("Fixed zeta.\n")
    (changes / "12.alpha.added.md").write_text("Added alpha,\nover two lines.\n")
    (changes / "49.beta.added.md").write_text("Added beta.\n")
    log = tmp_path / "changelog.md"
    log.write_text(
        f"# Changelog\n\n{changelog.MARKER}\n\n## 0.1.0 (not tagged yet)\n\n"
        "### Added\n\n- Old. (issue 1)\n\n### Fixed\n\n- Old fix. (issue 2)\n"
    )
    return changes, log


def test_fragments_render_as_the_unreleased_section_by_category(tmp_path: Path) -> None:
    changes, _ = _tree(tmp_path)
    text = changelog.render_section(
        "Unreleased", changelog.by_category(changelog.fragments(changes))
    )
    assert text == (
        "## Unreleased\n\n### Added\n\n- Added alpha,\n  over two lines. (issue 12)"
        "\n- Added beta. (issue 49)\n\n### Fixed\n\n- Fixed zeta. (issue 49)"
    )


def test_a_release_merges_the_fragments_into_its_section_and_deletes_them(tmp_path: Path) -> None:
    changes, log = _tree(tmp_path)
    (changes / "49.gone.removed.md").write_text("Removed gone.\n")
    done = changelog.release("0.1.0", "2027-01-01", log, changes)
    assert len(done) == 4 and not list(changes.iterdir())
    text = log.read_text()
    assert text.index("- Added alpha") < text.index("- Old. (issue 1)")
    assert text.index("### Removed") < text.index("### Fixed") < text.index("- Fixed zeta")
    assert text.index("- Fixed zeta") < text.index("- Old fix")


def test_a_release_of_a_new_version_gets_a_section_under_the_marker(tmp_path: Path) -> None:
    changes, log = _tree(tmp_path)
    changelog.release("0.2.0", "2027-02-01", log, changes)
    text = log.read_text()
    assert text.index(changelog.MARKER) < text.index("## 0.2.0 (2027-02-01)")
    assert text.index("## 0.2.0") < text.index("## 0.1.0")


def test_the_changelog_has_the_marker_and_only_keep_a_changelog_categories() -> None:
    text = (ROOT / "docs" / "changelog.md").read_text()
    assert text.count(changelog.MARKER) == 1
    headings = re.findall(r"^### (.+)$", text, re.M)
    assert headings and set(headings) <= {c.capitalize() for c in changelog.CATEGORIES}
