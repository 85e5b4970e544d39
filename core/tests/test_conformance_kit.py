"""Unit tests of the conformance kit's own parts: the poll log's rules, bounded waits, error
mapping across the peer-host pipe, the child process controls, and the pytest plugin's options.
(The suites and machines themselves are tested in ``tests/conformance``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from p2pkv.contracts import CancelMode, PollResult
from p2pkv.errors import PeerRejected
from p2pkv.testing.child import Child
from p2pkv.testing.peers import PeerHost, RemotePeerError, _decode_error
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import WaitTimeout, wait_until


class Scripted:
    """A fake transport whose polls return what the test queued."""

    def __init__(self) -> None:
        self.results: list[PollResult] = []
        self.kept: list[int] = []

    def poll(self, peer_id: str | None) -> PollResult:
        return self.results.pop(0) if self.results else PollResult([], [])

    def cancel(self, ids: object, mode: CancelMode) -> list[int]:
        return list(self.kept)


def log_with(*results: PollResult) -> tuple[PollLog, Scripted]:
    fake = Scripted()
    fake.results.extend(results)
    log = PollLog(fake.poll, fake.cancel)
    log.submitted(1, "a")
    log.submitted(2, "b")
    return log, fake


def test_poll_log_accepts_a_correct_history() -> None:
    log, _ = log_with(PollResult([1], []), PollResult([], [2]))
    log.poll("a")
    log.poll("b")
    assert log.done == {1} and log.failed == {2} and not log.pending


@pytest.mark.parametrize(("results", "scope", "message"), [
    ((PollResult([1], [1]),), None, "both done and failed"),
    ((PollResult([1], []), PollResult([1], [])), None, "reported twice"),
    ((PollResult([7], []),), None, "unknown transfer id"),
    ((PollResult([2], []),), "a", "poll('a') reported transfer 2 of peer 'b'"),
    ((PollResult([1, 1], []),), None, "repeated in one poll"),
])
def test_poll_log_rejects(results: tuple[PollResult, ...], scope: str | None,
                          message: str) -> None:
    log, _ = log_with(*results)
    with pytest.raises(AssertionError, match=re.escape(message)):
        for _ in results:
            log.poll(scope)


def test_poll_log_ids_must_be_fresh_ints() -> None:
    log, _ = log_with()
    with pytest.raises(AssertionError, match="issued twice"):
        log.submitted(1, "a")
    with pytest.raises(AssertionError, match="must be an int"):
        log.submitted(True, "a")


def test_poll_log_cancel_rules() -> None:
    log, fake = log_with(PollResult([1], []))
    assert log.cancel([1], CancelMode.WAIT) == []
    with pytest.raises(AssertionError, match="cancelled"):
        log.poll("a")
    fake.kept = [2]
    with pytest.raises(AssertionError, match=r"IMMEDIATE\) must return \[\]"):
        log.cancel([2], CancelMode.IMMEDIATE)
    fake.kept = [9]
    with pytest.raises(AssertionError, match="not given"):
        log.cancel([2], CancelMode.WAIT)


def test_wait_until_returns_the_value_and_pumps() -> None:
    pumped: list[int] = []
    assert wait_until(lambda: len(pumped) >= 3 and "ok", timeout=5, what="three pumps",
                      pumps=[lambda: pumped.append(1)]) == "ok"


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(WaitTimeout, match="the impossible"):
        wait_until(lambda: False, timeout=0.01, what="the impossible")


def test_errors_keep_their_class_across_the_pipe() -> None:
    assert isinstance(_decode_error("p2pkv.errors", "PeerRejected", "no"), PeerRejected)
    assert isinstance(_decode_error("builtins", "KeyError", "k"), KeyError)
    assert isinstance(_decode_error("numpy", "AxisError", "x"), RemotePeerError)


def test_peer_host_reraises_child_errors_and_survives_them() -> None:
    with PeerHost(timeout=60) as host:
        with pytest.raises(KeyError):
            host.call("call", 12345, "poll", (None,))  # no such peer in the child
        with pytest.raises(ValueError, match="no method"):
            host.call("call", 1, "__del__", ())
        with pytest.raises(ValueError, match="unknown request"):
            host.call("format_disk")
        assert host.child.process.is_alive()


def _echo(conn: object) -> None:
    while True:
        conn.send(conn.recv())  # type: ignore[attr-defined]


def test_child_pause_resume_and_kill() -> None:
    with Child(_echo) as child:
        assert child.request("a", 30) == "a"
        child.pause()
        child.send("b")
        with pytest.raises(TimeoutError, match="sent no"):
            child.recv(0.2)
        child.resume()
        assert child.recv(30) == "b"
        child.kill()
        assert not child.process.is_alive()


def test_plugin_refuses_bad_options_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--p2pkv-transport", "x", "--p2pkv-options", "[1",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120, check=False, cwd=str(tmp_path),
    )
    assert proc.returncode != 0 and "--p2pkv-options" in proc.stderr + proc.stdout
