"""A child process hosting one real ``vllm.LLM`` engine on the tiny test model (CPU).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process per
engine, so killing the child kills the engine). The host steps it exactly as vLLM's engine
core busy loop does: whenever the scheduler has requests or pending connector work
(``scheduler.has_requests()``, which includes the P2P tier's ``has_pending_work``), else it
waits for the test's next command. Requests carry ``kv_transfer_params`` through
``SamplingParams.extra_args``, greedy decoding.

Commands (tuples) and replies over the ``p2pkv.testing.child.Child`` pipe:

- first, unasked: ``("ready",)`` once the engine is built (or ``("failed", traceback)``);
- ``("submit", req_id, prompt_token_ids, max_tokens, kv_transfer_params)``: no reply; later
  ``("done", req_id, output_token_ids, num_cached_tokens)``;
- ``("metrics",)`` -> ``("metrics", {name or name{k=v,...}: value})`` (vLLM's own
  Prometheus metrics, counters and gauges);
- ``("loading",)`` -> ``("loading", n)``: promotion jobs open in the tiering manager (loads
  from the secondary tier into the CPU tier), read from the manager itself (its private
  ``_transfer_jobs``, shaped differently on 0.27.1 and 0.32): vLLM 0.27.1 has no gauge of
  them, and its offline engine drops the stats of a step without request outputs;
- ``("log",)`` -> ``("log", [line, ...])``: the INFO and higher records that p2pkv's loggers
  (``p2pkv*``) emitted in this engine so far;
- ``("marks", req_id)`` -> ``("marks", {mark: monotonic seconds})``: when the p2pkv tier's
  engine calls for that request happened (:class:`_PullClock`);
- ``("shutdown",)`` -> ``("down", leftover_shm_files)``.

Only imported in the ``engine`` session's environment.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "UCX_NET_DEVICES": "lo",
}
"""Environment of every test engine (set before vLLM is imported)."""
BLOCK_SIZE = 32
"""Tokens per KV block: the CPU attention backend needs a multiple of 32."""


def engine_kwargs(model: str, kv_transfer_config: dict[str, Any] | None,
                  engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of a small deterministic CPU engine (``engine_args`` added,
    e.g. ``kv_cache_dtype``)."""
    return {
        "model": model, "dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": 1024,
        "max_num_seqs": 4, "enforce_eager": True, "seed": 0, "disable_log_stats": False,
        "kv_cache_memory_bytes": 32 * 1024 * 1024, "kv_transfer_config": kv_transfer_config,
        **(engine_args or {}),
    }


def metric_values(metrics: list[Any]) -> dict[str, float]:
    """vLLM's metric snapshot as ``{name{label=value,...}: value}`` (counters and gauges;
    the ``engine`` and ``model_name`` labels dropped)."""
    out: dict[str, float] = {}
    for metric in metrics:
        value = getattr(metric, "value", None)
        if not isinstance(value, (int, float)):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items())
                          if k not in ("engine", "model_name"))
        out[f"{metric.name}{{{labels}}}" if labels else metric.name] = float(value)
    return out


class _P2PKVLog(logging.Handler):
    """Keeps the INFO and higher lines of p2pkv's loggers (attached to the root logger, which
    they propagate to)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.addFilter(lambda record: record.name.startswith("p2pkv"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


class _PullClock:
    """When the p2pkv tier's engine calls for each request happened, kept by wrapping
    ``P2PKVTier``'s methods in this process (the tier is untouched): ``lookup`` (its first
    lookup), ``hit`` (its first lookup answered HIT: the source answered the probe, and a
    fresh peer's dial and handshake before it), ``load`` (its load submitted) and ``loaded``
    (that load's result reported). Times are ``time.monotonic()`` of this process, taken at
    the call, so they include the engine's step cadence (vLLM calls ``lookup`` once a step
    while the answer is pending)."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        self._job_requests: dict[int, str] = {}

    def install(self) -> None:
        from p2pkv_vllm.adapter import P2PKVTier

        lookup, submit_load = P2PKVTier.lookup, P2PKVTier.submit_load
        finished = P2PKVTier.get_finished_jobs

        def timed_lookup(tier: Any, key: Any, req_context: Any) -> Any:
            result = lookup(tier, key, req_context)
            self._mark(req_context.req_id, "lookup")
            if result.name == "HIT":
                self._mark(req_context.req_id, "hit")
            return result

        def timed_submit_load(tier: Any, job: Any) -> None:
            self._job_requests[job.job_id] = job.req_context.req_id
            self._mark(job.req_context.req_id, "load")
            submit_load(tier, job)

        def timed_finished(tier: Any) -> Any:
            results = list(finished(tier))
            for result in results:
                req_id = self._job_requests.pop(result.job_id, None)
                if req_id is not None:
                    self._mark(req_id, "loaded")
            return results

        P2PKVTier.lookup = timed_lookup  # type: ignore[method-assign]
        P2PKVTier.submit_load = timed_submit_load  # type: ignore[method-assign]
        P2PKVTier.get_finished_jobs = timed_finished  # type: ignore[method-assign]

    def _mark(self, req_id: str, mark: str) -> None:
        self.marks.setdefault(req_id, {}).setdefault(mark, time.monotonic())

    def of(self, req_id: str) -> dict[str, float]:
        """The marks of the request the test submitted as ``req_id`` (vLLM may have
        suffixed its id)."""
        return next((marks for key, marks in self.marks.items() if key.startswith(req_id)),
                    {})


class _Host:
    def __init__(self, conn: Connection, model: str, kv_transfer_config: Any,
                 engine_args: dict[str, Any]) -> None:
        from vllm import LLM

        self.log = _P2PKVLog()
        self.clock = _PullClock()
        if kv_transfer_config is not None:
            self.clock.install()
        logging.getLogger().addHandler(self.log)
        logging.getLogger("p2pkv").setLevel(logging.INFO)
        self.conn = conn
        self.llm = LLM(**engine_kwargs(model, kv_transfer_config, engine_args))
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.engine_id = (kv_transfer_config or {}).get("engine_id")

    def submit(self, req_id: str, prompt: list[int], max_tokens: int, params: Any) -> None:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": params} if params else None
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  extra_args=extra)  # random weights: EOS means nothing
        self.llm.llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, sampling)

    def step(self) -> None:
        for out in self.llm.llm_engine.step():
            if out.finished:
                self.conn.send(("done", out.request_id, list(out.outputs[0].token_ids),
                                out.num_cached_tokens))

    def loading(self) -> int:
        manager = self.core.scheduler.connector.connector_scheduler.manager
        jobs = manager._transfer_jobs.values()  # 0.32: (TransferJob, tier); 0.27.1: the job
        return sum(getattr(job, "transfer_job", job).is_promotion for job in jobs)

    def busy(self) -> bool:
        return bool(self.core.scheduler.has_requests())

    def shutdown(self) -> list[str]:
        """Shut the engine down; returns the offload regions it left in /dev/shm."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.engine_id is None:
            return []
        return sorted(glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}*"))


def register_test_tiers(kv_transfer_config: Any) -> None:
    """Register every secondary tier the config names by ``module_path`` with vLLM's tier
    factory under its ``type`` (the class name), unless registered already: vLLM 0.27.1's
    factory resolves ``type`` through its registry only (0.30 and later also import
    ``module_path``). How the test-only tiers (``corrupting_tier``) load on every release; the
    product registers its own through its ``vllm.general_plugins`` entry point."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    extra = (kv_transfer_config or {}).get("kv_connector_extra_config", {})
    for tier in extra.get("secondary_tiers", []):
        if "module_path" in tier and tier["type"] not in SecondaryTierFactory._registry:
            SecondaryTierFactory.register_tier(tier["type"], tier["module_path"], tier["type"])


def llm_host(conn: Connection, model: str, kv_transfer_config: Any,
             env: dict[str, str], engine_args: dict[str, Any] | None = None) -> None:
    """Child entry point: build the engine, then serve commands until ``shutdown``."""
    os.environ.update({**ENGINE_ENV, **env})
    if (engine_args or {}).get("tensor_parallel_size", 1) > 1:
        # the test's engine processes are daemons, which may not start the TP workers
        multiprocessing.current_process().daemon = False
    try:
        register_test_tiers(kv_transfer_config)
        host = _Host(conn, model, kv_transfer_config, engine_args or {})
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise
    conn.send(("ready",))
    while True:
        if conn.poll(0 if host.busy() else 1.0):
            try:
                cmd = conn.recv()
            except EOFError:  # the test went away
                host.shutdown()
                return
            if cmd[0] == "submit":
                host.submit(*cmd[1:])
            elif cmd[0] == "metrics":
                conn.send(("metrics", metric_values(host.llm.get_metrics())))
            elif cmd[0] == "loading":
                conn.send(("loading", host.loading()))
            elif cmd[0] == "log":
                conn.send(("log", list(host.log.lines)))
            elif cmd[0] == "marks":
                conn.send(("marks", host.clock.of(cmd[1])))
            elif cmd[0] == "shutdown":
                conn.send(("down", host.shutdown()))
                return
        if host.busy():
            host.step()
