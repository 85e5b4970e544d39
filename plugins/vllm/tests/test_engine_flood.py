"""Requests naming thousands of bogus peers while real PD traffic runs, between real engines
(``nox -s engine_flood``: not in CI; ``P2PKV_ENGINE_FLOOD`` bogus requests, default 2,000).

A prefiller ``P`` and a decoder ``D`` (p2pkv, the default ``peers`` policy: any peer, at
most 256 dialed sessions) serve ``REAL`` PD requests in each of three phases, the decode
legs sent to ``D`` one after another:

- **unloaded**: nothing else;
- **plain flood**: before each decode leg, ``per_real`` short requests to ``D`` that name no
  peer (what any flood of requests costs the engine);
- **bogus flood**: the same requests, each naming a distinct peer in ``remote_prefiller``:
  half refuse (a port bound, not listening), half are black-holed (a listener that never
  accepts), so the dials fail at once or hold their sockets until the handshake deadline.

Midway through the bogus flood, ``D`` makes its first request to a producer ``F`` it never
contacted. Asserted (behaviour): every real request's tokens equal a reference engine's and
its prompt came over the tier (vLLM's external-token counter grows by its full blocks); so
does ``F``'s; ``D``'s descriptors and threads come back to their baseline and its RSS within
64 MiB of it once the bogus sessions (and ``F``) end; ``D``'s p2pkv log stays within the rate limit.
Reported (not asserted): real requests per second in each phase and the ratios, in
docs/security.md.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.flood, pytest.mark.timeout(1800)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine_flood)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine_flood)")

from engine_kit import (  # noqa: E402
    EXTERNAL_TOKENS,
    P2PKV_TIER,
    WAIT,
    Engine,
    delta,
    free_port,
    full_blocks,
    pd_params,
    prompt,
    running,
)
from llm_host import BLOCK_SIZE  # noqa: E402

FLOOD = int(os.environ.get("P2PKV_ENGINE_FLOOD", "2000"))
"""Bogus requests in the bogus-flood phase (``P2PKV_ENGINE_FLOOD``; the plain flood sends
as many)."""
REAL = 20
"""Real PD requests per phase."""
BOGUS_TOKENS = 24
"""Prompt tokens of a flood request (short: its engine work is small next to a real one's)."""
SETTLE = 120.0
"""Seconds ``D`` has to end the bogus sessions and free their resources (the handshake
deadline is 10 s; libzmq closes sockets lazily)."""


def log_budget(seconds: float) -> int:
    """The most warnings ``D``'s two rate-limited p2pkv logs (the tier's, the zmq
    transport's) may write in ``seconds``: 20 at once, then 2 a second, plus a summary line
    per 10 s each; and a few lines about real peers."""
    return int(2 * (20 + 2.1 * seconds + seconds / 10 + 1)) + 10


def process_usage(pid: int) -> tuple[int, int, int]:
    """(open descriptors, threads, RSS in KiB) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, threads, rss


@pytest.fixture
def bogus_ports() -> Iterator[tuple[int, int]]:
    """(a port that refuses, a port that is black-holed) on every loopback address."""
    with socket.socket() as refusing, socket.socket() as black_hole:
        refusing.bind(("0.0.0.0", 0))
        black_hole.bind(("0.0.0.0", 0))
        black_hole.listen(1)
        yield refusing.getsockname()[1], black_hole.getsockname()[1]


class Traffic:
    """Real PD requests from a producer to ``D``, flood requests to ``D`` before each decode
    leg; ``D``'s results arrive in any order."""

    def __init__(
        self, prefiller: Engine, decoder: Engine, reference: Engine, ports: tuple[int, int]
    ) -> None:
        self.prefiller, self.decoder, self.reference = prefiller, decoder, reference
        self.ports = ports
        self.sent = 0
        self.sent_real = 0
        """Real requests sent (their prompts all differ: no local prefix-cache hits)."""
        self.flood_open = 0

    def flood(self, naming_peers: bool) -> None:
        """Send ``D`` the next flood request (naming a distinct bogus peer, or none)."""
        i, self.sent = self.sent, self.sent + 1
        params = None
        if naming_peers:
            host = f"127.{1 + i // 62500}.{i // 250 % 250}.{2 + i % 250}"
            params = {
                "remote_prefiller": {
                    "kv_request_id": f"bogus-{i}",
                    "remote_host": host,
                    "remote_port": self.ports[i % 2],
                }
            }
        self.decoder.submit(f"flood-{i}", prompt(10_000_000 + i, BOGUS_TOKENS), 1, params)
        self.flood_open += 1

    def real(
        self, tag: str, seed: int, producer: Engine, per_real: int, naming_peers: bool
    ) -> None:
        """One PD request through ``producer`` and ``D`` (``per_real`` flood requests sent
        just before its decode leg): its tokens must equal the reference engine's."""
        tokens = prompt(seed, 200)
        expected = self.reference.generate(f"ref-{tag}", tokens, 8)[0]
        prefill, decode = pd_params(tag, producer)
        producer.generate(f"p-{tag}", tokens, 1, prefill)
        for n in range(per_real):
            self.flood(naming_peers)
            if n % 16 == 15:  # take D's results meanwhile: both sides of a pipe never
                self.collect_ready()  # block on a full buffer at once
        self.decoder.submit(f"d-{tag}", tokens, 8, decode)
        got, cached = self.collect(f"d-{tag}")
        assert got == expected, f"{tag}: tokens differ from the reference"
        assert cached == full_blocks(tokens) * BLOCK_SIZE, f"{tag}: {cached} tokens cached"

    def collect_ready(self) -> None:
        """Take the flood requests' results ``D`` has sent so far (it sends no other now)."""
        while self.decoder.child.pending():
            kind, done_id, _, _ = self.decoder.child.recv(WAIT, "D's results")
            assert kind == "done" and done_id.startswith("flood-"), (kind, done_id)
            self.flood_open -= 1

    def collect(self, wanted: str | None) -> tuple[list[int], int]:
        """``D``'s results until ``wanted``'s (its tokens and cached tokens), or until every
        flood request's (``wanted`` None)."""
        while wanted is not None or self.flood_open:
            kind, done_id, tokens, cached = self.decoder.child.recv(WAIT, "D's results")
            assert kind == "done", kind
            if done_id == wanted:
                return list(tokens), int(cached)
            assert done_id.startswith("flood-"), done_id
            self.flood_open -= 1
        return [], 0

    def phase(
        self, name: str, per_real: int, naming_peers: bool, first_contact: Engine | None = None
    ) -> float:
        """``REAL`` PD requests (``first_contact``, if given, is the middle one's producer):
        real requests per second, the phase's flood requests all answered."""
        began = time.monotonic()
        for i in range(REAL):
            producer = first_contact if first_contact and i == REAL // 2 else self.prefiller
            self.real(f"{name}-{i}", self.sent_real + i, producer, per_real, naming_peers)
        self.sent_real += REAL
        self.collect(None)
        return REAL / (time.monotonic() - began)


def test_a_flood_of_bogus_peers_leaves_real_pd_traffic_whole(
    tiny_model: str,
    bogus_ports: tuple[int, int],
) -> None:
    engines = [Engine("reference", tiny_model, None)]
    for name in ("p", "d", "f"):
        engines.append(Engine(name, tiny_model, {**P2PKV_TIER, "port": free_port()}))
    with running(*engines) as (reference, prefiller, decoder, fresh):
        traffic = Traffic(prefiller, decoder, reference, bogus_ports)
        per_real = max(1, FLOOD // REAL)
        traffic.phase("warm", 0, False)  # the P-D session and both engines' caches warm
        pid = decoder.child.process.pid
        assert pid is not None
        baseline = process_usage(pid)
        before = decoder.metrics()
        rates = {
            "unloaded": traffic.phase("unloaded", 0, False),
            "plain flood": traffic.phase("plain", per_real, False),
        }
        flood_began = time.monotonic()
        rates["bogus flood"] = traffic.phase("bogus", per_real, True, first_contact=fresh)
        pulled = delta(decoder.metrics(), before, EXTERNAL_TOKENS)
        assert pulled == 3 * REAL * full_blocks(prompt(0, 200)) * BLOCK_SIZE, pulled
        fresh.shutdown()  # D's session to it opened during the flood: not a leftover
        deadline = time.monotonic() + SETTLE
        while True:
            usage = process_usage(pid)
            if (
                usage[0] <= baseline[0]
                and usage[1] <= baseline[1]
                and usage[2] <= baseline[2] + 64 * 1024
            ):
                break
            assert time.monotonic() < deadline, (
                f"D's (fds, threads, RSS KiB) {usage} not back to {baseline} in {SETTLE}s"
            )
            decoder.metrics()  # a round trip to D: its engine thread steps meanwhile
        warnings = [line for line in decoder.p2pkv_log() if "WARNING" in line]
        print(
            f"\nengine flood: {per_real * REAL} requests naming bogus peers, {REAL} real PD "
            f"requests per phase; real requests/s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
            + f"; bogus/unloaded {rates['bogus flood'] / rates['unloaded']:.2f}, "
            f"bogus/plain {rates['bogus flood'] / rates['plain flood']:.2f}; "
            f"D logged {len(warnings)} warnings; D at baseline: {usage} vs {baseline}"
        )
        assert len(warnings) <= log_budget(time.monotonic() - flood_began), len(warnings)
