"""``P2PKVTier``: p2pkv's ``P2PTier`` as a vLLM secondary KV-offload tier (vLLM 0.32, 0.33).

vLLM loads it by module path, with no registration or patch::

    "secondary_tiers": [{"type": "P2PKVTier", "module_path": "p2pkv_vllm",
                         "control": "zmq", "data": "nixl"}]

This module imports vLLM (its factory requires a real ``SecondaryTierManager`` subclass);
``import p2pkv_vllm`` does not. The adapter is thin: it maps vLLM's jobs, request contexts
and lookup results onto p2pkv's and forwards; the protocol lives in ``p2pkv.tier``.

Threading: vLLM calls every method under its tiering manager's lock, from the scheduler
thread or its tier-poll thread (0.33; 0.32 has neither and calls from the scheduler thread
only), never concurrently; ``P2PTier`` needs exactly that.

Releases: the adapter runs on every vLLM release with this tier API (0.32.0 and 0.33.0 are
tested). Features a release lacks are degraded, never faked: see :data:`OPTIONAL_FEATURES`
and :func:`missing_features` (logged once when a tier starts).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar, cast

from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger
from p2pkv.tier import P2PTier
from p2pkv.types import LookupResult
from vllm.v1.kv_offload.base import (
    Locality,
    OffloadingMetricMetadata,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import LookupResult as VllmLookupResult
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ParentManager,
    SecondaryTierManager,
)

from p2pkv_vllm.backpressure import PDSafeDetector
from p2pkv_vllm.bridge import (
    UPSTREAM_TYPE,
    FailedLoadLog,
    ParentHitSource,
    check_engine_keys,
    context_of,
    idle_wait_of,
    job_of,
    preconnect_peers,
    resolve_hash_seed,
    tier_config_from_keys,
    zero_edit_keys,
)
from p2pkv_vllm.idle import IdleWatch, engine_waker
from p2pkv_vllm.metrics import StatsReporter, metric_definitions
from p2pkv_vllm.quiet import QuietPolls
from p2pkv_vllm.release import HIT_SOURCE, NEW_BLOCKS_ONLY, TransferJob, none_hash_seed
from p2pkv_vllm.start_line import log_start

__all__ = ["OPTIONAL_FEATURES", "P2PKVTier", "missing_features"]

log = module_logger(__name__)

_TO_VLLM = {
    LookupResult.HIT: VllmLookupResult.HIT,
    LookupResult.MISS: VllmLookupResult.MISS,
    LookupResult.RETRY: VllmLookupResult.RETRY,
}
_FROM_VLLM = {VllmLookupResult.HIT: LookupResult.HIT, VllmLookupResult.MISS: LookupResult.MISS}
_REQUEST_LEVEL = RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
_CHUNK_LEVEL = RequestOffloadingContext(policy=NEW_BLOCKS_ONLY)
_INFO_KEYS = ("p2pkv_address", "p2pkv_control", "p2pkv_data", "p2pkv_fingerprint")

OPTIONAL_FEATURES: Mapping[str, str] = {
    "tolerates_off_thread_polling": (
        "tier-poll thread (new in vLLM 0.33): without it the tier is served once per engine "
        "step, and while the engine sleeps by p2pkv's idle watcher, which wakes the engine "
        "when a peer needs it"
    ),
    "config_info": (
        "vllm:kv_offload_config_info labels (new in vLLM 0.33): the tier publishes none"
    ),
    "cache_hit_source": (
        "cache-hit source attribution (new in vLLM 0.32): prompt tokens loaded through the "
        "tier count as external hits without a source"
    ),
    "bp_detector": ("store back-pressure (new in vLLM 0.32): a backpressure block is not read"),
}
"""``SecondaryTierManager`` attributes of newer vLLM releases the adapter uses when present,
and what an engine without them lacks."""


_POLL_THREAD = hasattr(SecondaryTierManager, "tolerates_off_thread_polling")
"""This vLLM polls tiers from its own thread between engine steps (0.33 and later)."""
IDLE_WAIT = 0.25
"""Default ``idle_wait`` (tier key), vLLM before 0.33: the longest one wait for a peer's frame
while the engine sleeps (a frame, the tier's next deadline or an engine call ends it at
once)."""
_PACE = 0.02
"""Outside an engine loop (no idle watcher): the longest wait of the tier's tick in
``has_pending_work``, which paces an engine kept stepping (capped by ``idle_wait``)."""


_WATCH_CLOSE = 5.0
"""Seconds ``shutdown`` waits for the idle watcher's thread (its tick is interrupted)."""

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _engine_call(method: _Method) -> _Method:
    """Run ``method`` with the tier handed to the engine thread when an :class:`IdleWatch`
    drives it while the engine sleeps or computes (vLLM before 0.33); a plain call
    otherwise. After a schedule's end, each call lends the tier back to the watcher."""

    @functools.wraps(method)
    def call(self: P2PKVTier, *args: Any, **kwargs: Any) -> Any:
        watch = self._watch
        if watch is None:
            return method(self, *args, **kwargs)
        with watch.engine():
            result = method(self, *args, **kwargs)
            if self._lending:
                watch.lend()
            return result

    return cast(_Method, call)


def missing_features() -> list[str]:
    """What the running vLLM lacks of :data:`OPTIONAL_FEATURES` (empty on 0.33)."""
    return [
        why for name, why in OPTIONAL_FEATURES.items() if not hasattr(SecondaryTierManager, name)
    ]


def run_config(offloading_spec: Any) -> dict[str, Any]:
    """The run config vLLM uses to namespace offloaded KV (model, dtype, block geometry, KV
    groups), parallelism-agnostic only under ``canonical_layout``: peers whose run configs
    differ cannot share blocks.

    vLLM also calls the *direct* layout of a single full-attention group parallelism-agnostic
    (its bytes, concatenated over the ranks, said to be the same under any TP). Between real
    engines a TP 1 prefiller and a TP 2 decoder that trusted it exchanged chunks of the same
    length in another byte order and decoded wrong tokens (``test_engine_layouts``), so
    without ``canonical_layout`` the real parallel sizes stay in the config. A TP 1 engine's
    config is unchanged by this (all sizes 1), so it still matches earlier p2pkv releases."""
    config = offloading_spec.config
    run = dict(
        FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=config.cache.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
    )
    if not getattr(config, "canonical_layout", False):
        parallel = config.parallel
        run.update(
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
        )
    return run


def describe_run_config(run: Mapping[str, Any]) -> str:
    """``run_config`` in one line an operator compares between two engines (the KV-cache
    groups as their count and each group's tokens per block)."""
    groups = run.get("kv_cache_groups") or []
    parts = [f"{key}={value}" for key, value in run.items() if key != "kv_cache_groups"]
    shapes = "/".join(str(group.get("tokens_per_block")) for group in groups)
    return ", ".join([*parts, f"kv_cache_groups={len(groups)} (tokens per block {shapes})"])


class P2PKVTier(SecondaryTierManager):
    """vLLM secondary tier moving KV chunks peer to peer through ``p2pkv.tier.P2PTier``.

    Tier keys (all optional): ``control``, ``data``, ``host``, ``port``, ``control_options``,
    ``data_options``, ``timeouts``, ``limits``, ``fingerprint``, ``hash_seed`` (see
    docs/vllm.md). ``host``/``port`` default to ``VLLM_P2P_SIDE_CHANNEL_HOST`` /
    ``VLLM_P2P_SIDE_CHANNEL_PORT`` (then ``localhost`` / 5710); the bound port is base + DP
    rank. Unknown keys raise ``ConfigError``. A ``backpressure`` block may drop symmetric
    offers only, never a PD store (:mod:`p2pkv_vllm.backpressure`).
    """

    if HIT_SOURCE is not None:  # vLLM 0.32 and later attribute hits to a source
        cache_hit_source: ClassVar[Any] = HIT_SOURCE
    # Peers' fetches and lookups must be answered between engine steps too.
    tolerates_off_thread_polling: ClassVar[bool] = True
    _lending = False
    """From a schedule's end to the next schedule's first request call: the engine's calls
    lend the tier to the idle watcher as they return (vLLM 0.32 makes some after
    ``on_schedule_end``, e.g. ``get_finished_jobs`` from ``prepare_store``)."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_keys: Any,
    ) -> None:
        tier_keys.pop("module_path", None)  # vLLM 0.27.1 passes it on (later ones pop it)
        self._idle_wait = idle_wait_of(tier_keys, IDLE_WAIT)
        self._watch: IdleWatch | None = None
        """Drives the tier while the engine sleeps (vLLM before 0.33, inside an engine)."""
        locality = check_engine_keys(locality=tier_keys.pop("locality", None))
        if backpressure_detector is None:  # releases before 0.33 take no detector
            super().__init__(offloading_spec, primary_kv_view, tier_type)
        else:
            super().__init__(
                offloading_spec,
                primary_kv_view,
                tier_type,
                backpressure_detector=PDSafeDetector(backpressure_detector, self._serving_pd),
            )
        if locality is not None:
            self.locality = Locality(locality)
        if primary_kv_view.ndim != 2:
            raise ConfigError(
                f"P2PKVTier needs vLLM's 2-D primary view (chunks x bytes), got "
                f"{primary_kv_view.ndim}-D"
            )
        self._chunk_bytes = int(primary_kv_view.strides[0])  # type: ignore[index]
        parallel = offloading_spec.config.parallel
        if tier_type == UPSTREAM_TYPE:  # zero-edit mode: an entry written for vLLM's tier
            tier_keys = zero_edit_keys(tier_keys)
        run = run_config(offloading_spec)
        config = tier_config_from_keys(
            tier_keys,
            dp_rank=parallel.data_parallel_index,
            run_config=run,
            hash_seed=resolve_hash_seed(none_hash_seed()),
        )
        self._config = config
        self._seed_checked = False
        self._region = primary_kv_view.cast("B")
        try:
            self._tier = P2PTier(config, self._region, self.block_size_bytes)
        except BaseException:
            self._region.release()
            raise
        self._serial = itertools.count()
        self._quiet = QuietPolls() if _POLL_THREAD else None
        """vLLM's tier-poll thread (0.33): rounds that may leave a quiet tier alone."""
        self._hit_source: ParentHitSource | None = None
        """The hit source over the parent vLLM last passed (vLLM passes the same one every
        step and every tier-poll round; built once, not per call)."""
        self._stats = StatsReporter()
        self._failed_loads = FailedLoadLog(log)
        self._loads: dict[int, Any] = {}
        self._closed = False
        for lacking in missing_features():
            log.info("P2PKVTier: this vLLM has no %s", lacking)
        log.info(
            "P2PKVTier %s listening on %s (control %s, data %s, dp rank %d, %d chunks x %d B)",
            tier_type,
            self._tier.local_address,
            config.control,
            config.data,
            config.dp_rank,
            len(primary_kv_view),
            self.block_size_bytes,
        )
        log.info(
            "P2PKVTier run config (fingerprint %s; peers must match it): %s",
            config.fingerprint,
            describe_run_config(run),
        )
        log_start(tier_type, self._tier.local_address, config)

    @property
    def block_size_bytes(self) -> int:
        """Bytes per primary-tier chunk (the base class has it from vLLM 0.32 on)."""
        return self._chunk_bytes

    def _serving_pd(self) -> bool:
        """A PD producer request is open on the tier (its stores must not be dropped)."""
        tier = getattr(self, "_tier", None)
        return tier is not None and tier.producer_requests_open > 0

    # -- requests ----------------------------------------------------------------------------

    @_engine_call
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Parse the request's routing; a pre-connect hint (``p2pkv_connect``, see
        ``bridge.PRECONNECT_KEY``) opens sessions to the peers it names."""
        self._lending = False
        if not self._seed_checked:
            self._check_hash_seed()
        ctx = context_of(req_context)
        for peer in preconnect_peers(ctx.kv_transfer_params, ctx.req_id):
            self._tier.connect(peer)
        if self._tier.on_new_request(ctx):
            return _REQUEST_LEVEL
        return _CHUNK_LEVEL

    @_engine_call
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> VllmLookupResult:
        self._lending = False
        return _TO_VLLM[self._tier.lookup(key, context_of(req_context))]

    @_engine_call
    def submit_store(self, job_metadata: TransferJob) -> None:
        job = job_of(job_metadata, context_of(job_metadata.req_context))
        self._tier.submit_store(job)
        self._stats.job_submitted(job.job_id, is_load=False)

    @_engine_call
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._lending = False
        job = job_of(job_metadata, context_of(job_metadata.req_context))
        self._loads[job.job_id] = job.ctx
        self._tier.submit_load(job)
        self._stats.job_submitted(job.job_id, is_load=True)

    @_engine_call
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every finished job once; a failed load is logged at WARNING (rate-limited per
        outcome and peer: vLLM recomputes those blocks), a failed store at DEBUG. On vLLM's
        tier-poll thread a quiet tier ticks at most every ``QUIET_TICK`` (:mod:`.quiet`)."""
        quiet = self._quiet
        if quiet is not None and quiet.skip():
            return []
        results = self._tier.get_finished_jobs()
        if quiet is not None:
            quiet.ticked(bool(results) or self._tier.has_pending_work())
        self._stats.jobs_finished(results)
        for result in results:
            ctx = self._loads.pop(result.job_id, None)
            if result.success:
                continue
            if ctx is not None:
                self._failed_loads.failed(result, ctx)
            else:
                log.debug(
                    "P2PKVTier store job %d failed: %s %s",
                    result.job_id,
                    result.outcome.value,
                    result.detail,
                )
        return [JobResult(result.job_id, result.success) for result in results]

    @_engine_call
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._tier.on_request_finished(context_of(req_context))

    # -- engine step -------------------------------------------------------------------------

    @_engine_call
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The tier's last call of a schedule (vLLM's manager calls it last). Where the idle
        watcher runs (vLLM before 0.33), it drives the tier while the engine computes the
        step, so a peer's fetch is answered within that step (:meth:`IdleWatch.lend`)."""
        if self._quiet is not None:
            self._quiet.stirred()
        self._tier.on_schedule_end()
        self._lending = True

    @_engine_call
    def serve_external_requests(self, parent: ParentManager) -> None:
        self._lending = False
        source = self._hit_source
        if source is not None and self._quiet is not None and self._quiet.skip():
            return  # quiet: no lookup to answer (the first call, which builds the source,
            #         always serves: the tier learns it has a hit source before any probe)
        if source is None or not source.over(parent):
            source = self._hit_source = ParentHitSource(
                parent, new_context=ReqContext, results=_FROM_VLLM, serial=self._serial
            )
        self._tier.serve_lookups(source)

    @_engine_call
    def has_pending_work(self) -> bool:
        """True while the tier has work. On a vLLM without the tier-poll thread (before
        0.33), an idle tier hands itself to an :class:`~p2pkv_vllm.idle.IdleWatch` that
        serves peers while the engine sleeps and wakes it when they need it; outside an
        engine loop (no input queue on the stack) it keeps the engine stepping instead,
        paced by a wait of up to ``idle_wait`` for a peer's frame (docs/vllm.md, "Idle
        sources"). Once the watcher runs, only work for the engine's calls counts
        (``P2PTier.needs_engine``): the engine sleeps through a peer's handshake, which the
        watcher completes."""
        self._lending = False  # between steps: the engine sleeps, or steps again
        if self._tier.needs_engine() if self._watch else self._tier.has_pending_work():
            return True
        if _POLL_THREAD or not self._idle_wait:  # vLLM's tier-poll thread serves peers
            return False
        watch = self._watch or self._start_watch()
        if watch is not None:  # it serves peers while the engine sleeps, and wakes it
            watch.sleep()
            return False
        self._tier.tick(min(self._idle_wait, _PACE))  # no engine loop: keep stepping, paced
        return True

    def _start_watch(self) -> IdleWatch | None:
        """The idle watcher, once vLLM's engine loop is found on the stack (else None)."""
        wake = engine_waker()
        if wake is None:
            return None
        self._watch = IdleWatch(self._tier, wake, self._idle_wait)
        log.info(
            "P2PKVTier: this vLLM has no tier-poll thread; peers are served by a thread "
            "of ours while the engine sleeps, which wakes the engine when they need it"
        )
        return self._watch

    @_engine_call
    def drain_jobs(self) -> None:
        self._tier.drain_jobs()

    def shutdown(self) -> None:
        """Close the tier (bounded by its shutdown drain) and release the region view.

        vLLM reads no results after shutdown, so leftover ones are only logged.
        """
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.close(_WATCH_CLOSE)
        try:
            leftover = self._tier.shutdown()
            if leftover:
                log.info("P2PKVTier shut down with %d unreported job result(s)", len(leftover))
        finally:
            self._region.release()

    # -- observability -----------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @_engine_call
    def get_stats(self) -> Any:
        """The tier's counters for vLLM's metrics (vLLM 0.32 asks after a step's compute,
        while the idle watcher may hold the tier: it takes the tier back first)."""
        return self._stats.report(self._tier.stats())

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str]:
        values = (
            self._tier.local_address,
            self._config.control,
            self._config.data,
            self._config.fingerprint,
        )
        return dict(zip(_INFO_KEYS, values, strict=True))

    def _check_hash_seed(self) -> None:
        """Once the engine runs: complain if its block-hash seed is not the advertised one.

        vLLM seeds block hashes after building tiers; only a non-cryptographic hash
        algorithm without ``PYTHONHASHSEED`` (a random per-process seed) gets here, and then
        no peer can ever match this instance's blocks. The seed itself is never logged.
        """
        self._seed_checked = True
        if none_hash_seed() != self._config.hash_seed:
            log.error(
                "P2PKVTier: vLLM derives block hashes from a seed other than the one this "
                "tier advertises (a random per-process seed: non-cryptographic "
                "prefix_caching_hash_algo without PYTHONHASHSEED?), so peers will never "
                "match its blocks. Set PYTHONHASHSEED to one value on every instance."
            )
