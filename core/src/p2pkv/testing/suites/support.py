"""What every conformance suite shares: the transport under test, its options and
capabilities, and the peer host and modes (see :mod:`p2pkv.testing.suites`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest

from p2pkv.contracts import Capabilities, TransportKind
from p2pkv.errors import ConfigError
from p2pkv.testing.peers import PeerHost

PEER_MODES = ("same-process", "child-process")


def installed_transport(kind: TransportKind, name: str, *, missing: str = "skip") -> type[Any]:
    """The installed transport ``name`` of ``kind``, through the plugin registry.

    When it is not installed (or refused by the registry), the current test is skipped
    (``missing="skip"``) or failed (``missing="fail"``) with the registry's explanation.
    """
    from p2pkv.registry import default_registry

    try:
        return default_registry().transport(kind, name)
    except ConfigError as exc:
        (pytest.skip if missing == "skip" else pytest.fail)(str(exc))
        raise  # unreachable: skip and fail raise


class _SuiteBase:
    kind: ClassVar[TransportKind]
    transport: ClassVar[type[Any] | None] = None
    transport_name: ClassVar[str | None] = None
    missing_transport: ClassVar[str] = "fail"
    """When ``transport_name`` is not installed: ``"fail"`` every test with the registry's
    explanation (a misspelt name never makes a green run), or ``"skip"`` them (a suite over
    an optional transport, as this repository's over every published one)."""
    options: ClassVar[Mapping[str, Any]] = {}
    timeout: ClassVar[float] = 10.0
    same_process_pairs: ClassVar[bool] = True

    @pytest.fixture
    def transport_class(self) -> type[Any]:
        if self.transport is not None:
            return self.transport
        if self.transport_name is not None:
            return installed_transport(
                self.kind, self.transport_name, missing=self.missing_transport
            )
        pytest.fail(
            f"{type(self).__name__}: set `transport = YourTransport` (or `transport_name`) on "
            f"the suite subclass, or override the `transport_class` fixture"
        )

    @pytest.fixture
    def transport_options(self) -> Mapping[str, Any]:
        return dict(self.options)

    @pytest.fixture
    def capabilities(self, transport_class: type[Any]) -> Capabilities:
        missing = transport_class.availability()
        if missing is not None:
            pytest.skip(str(missing))
        caps = transport_class.capabilities
        assert isinstance(caps, Capabilities), (
            f"{transport_class.__name__}.capabilities must be a p2pkv Capabilities"
        )
        return caps

    @pytest.fixture(scope="class")
    @classmethod
    def peer_host(cls) -> Iterator[PeerHost]:
        """One child process per suite class, hosting every child-process peer of it."""
        with PeerHost(name=f"p2pkv-peers-{cls.__name__}") as host:
            yield host

    @pytest.fixture(params=PEER_MODES)
    def peer_mode(self, request: pytest.FixtureRequest, capabilities: Capabilities) -> str:
        if not (self.same_process_pairs or capabilities.cross_process):  # else all would skip
            pytest.fail(
                f"{type(self).__name__} sets same_process_pairs = False and its transport does "
                f"not claim cross_process: the kit has no way to build a peer, so every pair "
                f"test would be skipped; claim cross_process (peers then run in a child "
                f"process) or allow same-process pairs",
                pytrace=False,
            )
        mode: str = request.param
        if mode == "child-process" and not capabilities.cross_process:
            pytest.skip("transport does not claim cross_process")
        if mode == "same-process" and not self.same_process_pairs:
            pytest.skip("suite declares same_process_pairs = False")
        return mode

    @staticmethod
    def _require(flag: bool, reason: str) -> None:
        if not flag:
            pytest.skip(reason)
