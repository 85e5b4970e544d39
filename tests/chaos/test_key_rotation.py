"""Rotating the fleet's client key pair between live tiers, loads running (docs/security.md,
"Rotating keys"): no load fails.

Every tier (zmq + nixl, its own process, loopback) takes its keys from ``$P2PKV_CURVE_DIR``, a
directory laid out as kubelet lays out a Secret volume (``..data`` swapped to a fresh copy at
each update). The Secret goes through ``p2pkv keys --rotate begin|switch|finish --from -``
(the command an operator pipes ``kubectl get secret -o json`` into), each step published to
the mount while a consumer streams loads from a producer started before the rotation. After
each step, ``p2pkv probe`` (what an operator runs on every pod) is polled until the tiers
show it: the new client key admitted, then presented, then the old one refused. Producers
started mid-rotation (new pods, reading the Secret as it is then) are dialed by the consumer
started before it: it must present the key of the moment, re-read from its mount.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from chaos_cluster import Cluster, Node, Stream, measured, requests, tier_config
from chaos_node import NodeSpec
from p2pkv.addressing import parse_address
from p2pkv_tools.demo.roles import RoleSetup
from p2pkv_zmq.keys import key_fingerprint, read_key
from p2pkv_zmq.probe import probe
from p2pkv_zmq.security import fleet_keys

BLOCK = 16 * 1024
MAX_BLOCKS = 4
T = 90.0


class SecretMount:
    """A Secret volume as kubelet writes it: files are links through ``..data``, which is
    swapped to a fresh directory at each update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.version = 0

    def publish(self, secret: dict[str, object]) -> None:
        data = secret["data"]
        assert isinstance(data, dict)
        self.version += 1
        fresh = self.root / f"..v{self.version}"
        fresh.mkdir()
        for name, value in data.items():
            (fresh / name).write_bytes(base64.b64decode(value))
            (fresh / name).chmod(0o440)
        link = self.root / "..data_tmp"
        link.symlink_to(fresh.name)
        os.replace(link, self.root / "..data")
        for name in data:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")
        for entry in self.root.iterdir():
            if entry.is_symlink() and entry.name not in data and not entry.name.startswith(".."):
                entry.unlink()


def p2pkv_keys(*args: str, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "keys", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def fresh_secret() -> dict[str, object]:
    """``p2pkv keys --secret`` as ``kubectl get secret -o json`` would give it back."""
    manifest = p2pkv_keys("--secret", "p2pkv-curve", "--namespace", "llm-d").splitlines()
    data = dict(line.strip().split(": ", 1) for line in manifest[manifest.index("data:") + 1 :])
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": "p2pkv-curve", "namespace": "llm-d", "resourceVersion": "1"},
        "data": data,
    }


def files(secret: dict[str, object]) -> dict[str, str]:
    """The Secret's data (file name -> base64)."""
    data = secret["data"]
    assert isinstance(data, dict)
    return dict(data)


def client_fingerprint(data: dict[str, str]) -> str:
    text = base64.b64decode(data["client.key"]).decode()
    return key_fingerprint(read_key(text.split('"')[1], "client", "public"))


def keys_dir(data: dict[str, str], into: Path) -> Path:
    """Key files in a plain directory (an operator's copy, for ``p2pkv probe``)."""
    into.mkdir()
    for name, value in data.items():
        (into / name).write_bytes(base64.b64decode(value))
    return into


def spec(kind: str, mount: Path) -> NodeSpec:
    return NodeSpec(
        kind,
        RoleSetup(tier_config("127.0.0.1"), BLOCK, 40 * MAX_BLOCKS),
        env={"P2PKV_CURVE_DIR": str(mount)},
    )


def probed(node: Node, directory: Path) -> str:
    """``p2pkv probe``'s line for ``node`` with the keys of ``directory``."""
    host, port = parse_address(node.address)
    return probe(node.address, host, port, fleet_keys(directory), 5.0).line


def until(streams: list[Stream], done: Callable[[], bool], what: str) -> None:
    """Keep every stream going until ``done()`` (bounded by ``T``)."""
    deadline = time.monotonic() + T
    while not done():
        assert time.monotonic() < deadline, f"{what}: not reached in {T} s"
        for stream in streams:
            stream.step(0.01)


def rotated(secret: dict[str, object], step: str, mount: SecretMount) -> dict[str, object]:
    """``kubectl get secret -o json | p2pkv keys --rotate STEP --from - | kubectl apply``."""
    after: dict[str, object] = json.loads(
        p2pkv_keys("--rotate", step, "--from", "-", stdin=json.dumps(secret))
    )
    mount.publish(after)
    return after


def test_a_client_key_rotation_fails_no_load(tmp_path: Path) -> None:
    original = fresh_secret()
    mount = SecretMount(tmp_path / "mount")
    mount.publish(original)
    before = keys_dir(files(original), tmp_path / "before")
    old_client = client_fingerprint(files(original))
    with Cluster() as c:
        p0, c0 = c.start(("P0", spec("producer", mount.root)), ("C0", spec("consumer", mount.root)))
        streams = [
            Stream(
                c,
                requests(
                    10_000,
                    max_blocks=MAX_BLOCKS,
                    orders={"consumer_first": 1, "producer_first": 1},
                    run_id="rot0",
                ),
                p0,
                c0,
                window=4,
            )
        ]

        begun = files(rotated(original, "begin", mount))
        with_next = keys_dir(
            {
                **begun,
                "client.key": begun["client-next.key"],
                "client.key_secret": begun["client-next.key_secret"],
                "client-previous.key": begun["client.key"],
            },
            tmp_path / "next",
        )
        until(
            streams,
            lambda: probed(p0, with_next).startswith("p2pkv tier at"),
            "P0 admits the new client key",
        )

        switched = rotated({**original, "data": begun}, "switch", mount)
        new_client = client_fingerprint(files(switched))
        current = keys_dir(files(switched), tmp_path / "switched")
        until(
            streams,
            lambda: f"its client key {new_client})" in probed(c0, current),
            "C0 presents the new client key",
        )
        (p1,) = c.start(("P1", spec("producer", mount.root)))
        streams.append(
            Stream(
                c,
                requests(
                    40,
                    max_blocks=MAX_BLOCKS,
                    orders={"consumer_first": 1},
                    run_id="rot1",
                    first_index=100_000,
                ),
                p1,
                c0,
                window=4,
            )
        )

        rotated(switched, "finish", mount)
        until(
            streams,
            lambda: "refused this fleet's client key" in probed(p0, before),
            "P0 refuses the old client key",
        )
        (p2,) = c.start(("P2", spec("producer", mount.root)))
        streams.append(
            Stream(
                c,
                requests(
                    40,
                    max_blocks=MAX_BLOCKS,
                    orders={"consumer_first": 1},
                    run_id="rot2",
                    first_index=200_000,
                ),
                p2,
                c0,
                window=4,
            )
        )
        until(
            streams,
            lambda: all(not s.pending and not s.active for s in streams[1:]),
            "the loads from the producers started mid-rotation",
        )
        streams[0].pending.clear()
        streams[0].run(T, "the loads in flight from P0")
        recs = [r for s in streams for r in s.admitted]
        failed = [r.describe() for r in recs if r.load_outcome != "done"]
        assert not failed, failed[:10]
        assert not c.flow.problems(recs), c.flow.problems(recs)[:10]
        measured(
            f"client key rotation {old_client} -> {new_client}: {len(recs)} loads, "
            f"0 failed (one consumer throughout; 2 of 3 producers started mid-rotation)"
        )
