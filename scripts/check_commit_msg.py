"""Refuse a commit message whose subject line is longer than 72 characters.

The subject says what changed in a few words; the detail goes in the body, after a blank
line. Used by the ``commit-msg`` hook of ``.pre-commit-config.yaml`` (``python
scripts/check_commit_msg.py .git/COMMIT_EDITMSG``); ``tests/test_commits.py`` holds every
commit since the rule began to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72


def subject_problem(message: str) -> str:
    """Why ``message``'s subject breaks the rule, or ``""``. Comment lines (``#``) are git's."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    subject = lines[0].rstrip() if lines else ""
    if not subject:
        return "the subject line is empty"
    if len(subject) > MAX_SUBJECT:
        return (
            f"the subject is {len(subject)} characters, over {MAX_SUBJECT}: say it shorter "
            f"and put the detail in the body, after a blank line"
        )
    if len(lines) > 1 and lines[1].strip():
        return "the second line must be blank (the body starts on the third)"
    return ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/check_commit_msg.py MESSAGE_FILE", file=sys.stderr)
        return 2
    problem = subject_problem(Path(argv[0]).read_text())
    if problem:
        print(f"commit message refused: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
