"""Types of the nixl tests' fixtures, importable by name (a conftest is not).

``conftest.py`` builds the fixtures; test functions annotate their parameters with these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from p2pkv.contracts import DataSettings
from p2pkv.testing.peers import pattern
from p2pkv.testing.polllog import PollLog
from p2pkv_nixl import NixlDataTransport


class Recorder:
    """Wraps a transport's NIXL agent and records the calls that matter for ordering.

    ``calls`` holds ``(method, detail)``: the state for ``check_xfer_state``, ``id(handle)``
    for ``transfer``/``release_xfer_handle``/``initialize_xfer``, the result otherwise.
    ``state`` maps ``id(handle)`` to the last state NIXL reported. With ``refuse_release`` set,
    releasing a transfer handle raises (a backend refusing to free it); ``on_check`` runs after
    every state check.
    """

    RECORDED = (
        "make_prepped_xfer",
        "initialize_xfer",
        "transfer",
        "check_xfer_state",
        "release_xfer_handle",
        "release_dlist_handle",
        "remove_remote_agent",
        "deregister_memory",
        "add_remote_agent",
        "send_notif",
    )

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.calls: list[tuple[str, Any]] = []
        self.state: dict[int, str] = {}
        self.refuse_release = False
        self.on_check: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._agent, name)
        if name not in self.RECORDED:
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "release_xfer_handle" and self.refuse_release:
                self.calls.append(("release_refused", id(args[0])))
                raise RuntimeError("NIXL_ERR_UNKNOWN (simulated refusal)")
            result = target(*args, **kwargs)
            if name in ("transfer", "check_xfer_state"):
                self.state[id(args[0])] = result
            if name == "check_xfer_state":
                detail: Any = result
            elif name in ("transfer", "release_xfer_handle"):
                detail = id(args[0])
            elif name == "initialize_xfer":
                detail = id(result)
            else:
                detail = result
            self.calls.append((name, detail))
            if name == "check_xfer_state" and self.on_check is not None:
                self.on_check()
            return result

        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class Local:
    """A transport in this process over a patterned region; closed by the fixture."""

    def __init__(self, num_blocks: int, block_len: int, options: dict[str, Any], seed: int):
        self.array = pattern(seed, num_blocks * block_len)
        self.blocks = self.array.reshape(num_blocks, block_len)
        self.transport = NixlDataTransport.create(DataSettings(self.array.data, block_len, options))


class MakeLocal(Protocol):
    """The ``make_local`` fixture: a :class:`Local` closed after the test."""

    def __call__(
        self, num_blocks: int = 64, block_len: int = 4096, seed: int = 1, **options: Any
    ) -> Local: ...


class WaitFor(Protocol):
    """The ``wait_for`` fixture: ``(done, failed)`` once every id in ``ids`` ended."""

    def __call__(
        self, transport: NixlDataTransport, peer_id: str | None, ids: set[int]
    ) -> tuple[set[int], set[int]]: ...


MakeRecorder = Callable[[NixlDataTransport], Recorder]
"""The ``record`` fixture: wraps a transport's agent in a :class:`Recorder`."""

MakePollLog = Callable[[NixlDataTransport], PollLog]
"""The ``poll_log`` fixture: a kit ``PollLog`` over a transport's ``poll``/``cancel``."""
