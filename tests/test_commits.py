"""Commit subjects are at most 72 characters, for every commit made since the rule began.

The subject says what changed; the detail goes in the body. The ``commit-msg`` hook of
``.pre-commit-config.yaml`` refuses a long subject before the commit exists; this test holds
the history to the same rule where no hook ran (``scripts/check_commit_msg.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULE_BEGAN_AFTER = "fb4a4b8"
"""The last commit before the rule (issue 49): only commits after it are checked."""
RULE_BEGAN_AT = 1796576000
"""When the rule began to bind (2026-12-06 16:53 UTC, committer time): branches begun before it
were merged later with their older subjects, which stay as they are."""

sys.path.insert(0, str(ROOT / "scripts"))
from check_commit_msg import MAX_SUBJECT, subject_problem  # noqa: E402


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_commit_subjects_since_the_rule_are_short() -> None:
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode:
        pytest.skip("not a git checkout")
    if _git("cat-file", "-e", f"{RULE_BEGAN_AFTER}^{{commit}}").returncode:
        pytest.skip(f"{RULE_BEGAN_AFTER} is not in this clone's history (shallow clone?)")
    log = _git("log", "--format=%ct %h %s", f"{RULE_BEGAN_AFTER}..HEAD")
    assert log.returncode == 0, log.stderr
    rows = [line.split(" ", 2) for line in log.stdout.splitlines()]
    long = [
        f"{short} {subject}"
        for when, short, subject in rows
        if int(when) > RULE_BEGAN_AT and len(subject) > MAX_SUBJECT
    ]
    assert not long, f"subjects over {MAX_SUBJECT} characters:\n" + "\n".join(long)


def test_the_hook_refuses_a_long_subject_and_a_body_without_a_blank_line() -> None:
    assert subject_problem("fix: a short subject\n\nthe detail, as long as it needs\n") == ""
    assert subject_problem("# only git's comments\nsubject\n") == ""
    assert "over 72" in subject_problem("x" * 73)
    assert "empty" in subject_problem("\n\nbody")
    assert "second line must be blank" in subject_problem("subject\nbody at once\n")
