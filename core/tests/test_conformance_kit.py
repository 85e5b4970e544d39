"""Unit tests of the conformance kit's own parts: the poll log's rules, bounded waits, error
mapping across the peer-host pipe, the child process controls, and the pytest plugin's options.
(The suites and machines themselves are tested in ``tests/conformance``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from p2pkv.contracts import PollResult
from p2pkv.errors import PeerRejected
from p2pkv.testing.child import Child
from p2pkv.testing.peers import PeerHost, RemotePeerError, _decode_error
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import WaitTimeout, wait_until


class Scripted:
    """A fake transport whose polls return what the test queued."""

    def __init__(self) -> None:
        self.results: list[PollResult] = []
        self.cancel_returns: object = None

    def poll(self, peer_id: str | None) -> PollResult:
        return self.results.pop(0) if self.results else PollResult([], [])

    def cancel(self, ids: object) -> object:
        return self.cancel_returns


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


@pytest.mark.parametrize(
    ("results", "scope", "message"),
    [
        ((PollResult([1], [1]),), None, "both done and failed"),
        ((PollResult([1], []), PollResult([1], [])), None, "reported twice"),
        ((PollResult([7], []),), None, "no read of ours"),
        ((PollResult([2], []),), "a", "poll('a') reported transfer 2 of peer 'b'"),
        ((PollResult([1, 1], []),), None, "repeated in one poll"),
    ],
)
def test_poll_log_rejects(results: tuple[PollResult, ...], scope: str | None, message: str) -> None:
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


def test_poll_log_cancel_is_final() -> None:
    log, fake = log_with(PollResult([1], []))
    log.cancel([1])
    with pytest.raises(AssertionError, match="was ended"):
        log.poll("a")
    fake.cancel_returns = [2]  # the old WAIT answer: "could not stop these"
    with pytest.raises(AssertionError, match="cancel is final and returns None"):
        log.cancel([2])


def test_poll_log_remove_peer_and_close_end_reads() -> None:
    log, _ = log_with(PollResult([], [2]))
    assert log.ended_peer("a") == {1}
    assert log.pending == {2}
    log.poll("b")
    assert log.ended_all() == set()
    log.submitted(3, "a")
    assert log.ended_all() == {3} and not log.pending


def test_poll_log_undrained_ids_are_never_reads() -> None:
    log, _ = log_with()
    assert log.undrained([900, 901], "remove_peer", "a") == {900, 901}  # internal: fine
    with pytest.raises(AssertionError, match=r"remove_peer of peer 'a' returned read ids \[1\]"):
        log.undrained([1, 900], "remove_peer", "a")
    with pytest.raises(AssertionError, match=r"close returned read ids \[2\]"):
        log.undrained([2], "close")


def test_poll_log_never_reports_internal_ids() -> None:
    log, _ = log_with(PollResult([900], []))
    with pytest.raises(AssertionError, match="no read of ours"):
        log.poll(None)


def test_wait_until_returns_the_value_and_pumps() -> None:
    pumped: list[int] = []
    assert (
        wait_until(
            lambda: len(pumped) >= 3 and "ok",
            timeout=5,
            what="three pumps",
            pumps=[lambda: pumped.append(1)],
        )
        == "ok"
    )


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


def test_child_data_peers_read_cancel_and_canary_across_the_pipe() -> None:
    """The child-process proxy carries the read path: two memory peers in one host read from
    each other; numpy indexes cross the pipe as ints; pause/resume stop and restart the host."""
    np = pytest.importorskip("numpy")
    memory = pytest.importorskip("p2pkv_memory")
    with PeerHost(timeout=60) as host:
        a = host.data_peer(memory.MemoryDataTransport, 4, 8, {"completion_polls": 1})
        b = host.data_peer(memory.MemoryDataTransport, 4, 8, {})
        a.add_peer("b", b.descriptor)
        b.fill(5)
        tid = a.read_blocks("b", np.array([2, 0]), [np.int64(1), 3])
        assert a.poll("b") == ([], [])
        assert a.poll("b") == ([tid], [])
        theirs, ours = b.region_bytes(), a.region_bytes()
        assert ours[16:24] == theirs[8:16] and ours[:8] == theirs[24:32]
        late = a.read_blocks("b", [1], [1])
        assert a.cancel([late]) is None
        a.set_blocks([1], b"\x07" * 8)
        assert a.poll("b") == ([], []) and a.poll(None) == ([], [])
        assert a.region_bytes()[8:16] == b"\x07" * 8
        a.pause()
        a.resume()
        assert a.close() == []


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
        [
            sys.executable,
            "-m",
            "pytest",
            "--p2pkv-transport",
            "x",
            "--p2pkv-options",
            "[1",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=str(tmp_path),
    )
    assert proc.returncode != 0 and "--p2pkv-options" in proc.stderr + proc.stdout
