"""A child process hosting one real ``vllm.LLM`` engine on the tiny test model (CPU).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process per
engine, so killing the child kills the engine). The host runs it as vLLM's engine core
process does (``EngineCoreProc.run_busy_loop``): an input thread puts the test's commands
into an input queue; the engine steps whenever the scheduler has requests or pending
connector work (``scheduler.has_requests()``, which includes the P2P tier's
``has_pending_work``), else it blocks on that queue, where the P2P tier's idle watcher puts
vLLM's ``WAKEUP`` when a peer needs the engine (vLLM before 0.33; docs/vllm.md, "Idle
sources"). An idle engine therefore sleeps as a ``vllm serve`` engine does. Requests carry
``kv_transfer_params`` through ``SamplingParams.extra_args``, greedy decoding.

Commands (tuples) and replies over the ``p2pkv.testing.child.Child`` pipe:

- first, unasked: ``("ready",)`` once the engine is built (or ``("failed", traceback)``);
- ``("submit", req_id, prompt_token_ids, max_tokens, kv_transfer_params)``: no reply; later
  ``("done", req_id, output_token_ids, num_cached_tokens)``;
- ``("metrics",)`` -> ``("metrics", {name or name{k=v,...}: value})`` (vLLM's own
  Prometheus metrics, counters and gauges);
- ``("exposition",)`` -> ``("exposition", text)``: the Prometheus text of the process's
  default registry, where vLLM keeps its metrics: what its ``/metrics`` serves;
- ``("loading",)`` -> ``("loading", n)``: promotion jobs open in the tiering manager (loads
  from the secondary tier into the CPU tier), read from the manager itself (its private
  ``_transfer_jobs``, shaped differently on 0.27.1 and 0.32): vLLM 0.27.1 has no gauge of
  them, and its offline engine drops the stats of a step without request outputs;
- ``("log",)`` -> ``("log", [line, ...])``: the INFO and higher records that p2pkv's loggers
  (``p2pkv*``) emitted in this engine so far;
- ``("marks", req_id)`` -> ``("marks", {mark: value})``: when the p2pkv tier's engine calls
  for that request happened (monotonic seconds), and what its load's reads took (sums of
  seconds and counts; :class:`_PullClock`);
- ``("times", req_id)`` -> ``("times", {"submitted": s, "first_token": s, "finished": s})``:
  this process's ``time.monotonic()`` when the request was added to the engine, when a step
  first returned an output token of it and when it finished (keys missing until then; an
  unknown id: ``{}``); ``first_token - submitted`` is its TTFT without the pipe (:class:`_Times`);
- ``("churn", inflight, prompts[, kv_transfer_params])`` -> ``("churn", finished, active,
  queued)``: a stream of requests of this engine's own (greedy, ``max_tokens`` 1, results
  never sent; ``kv_transfer_params`` as given, e.g. ``{"max_offload_tokens": 0}``):
  ``prompts`` (token lists) are queued, and the host keeps ``inflight`` of them in flight,
  submitting the next as one finishes; ``inflight`` 0 drops the queue (those in flight
  finish). The reply counts the stream's requests finished so far, in flight, and queued
  (:class:`_Churn`);
- ``("steps",)`` -> ``("steps", [(seconds, tokens), ...])``: the wall time of every engine
  step since the last ``steps`` (at most the last ``STEPS_KEPT``) and the tokens its schedule
  gave the model (0: a step that ran no model, e.g. one waiting on a tier);
- ``("shutdown",)`` -> ``("down", leftover_shm_files)``.

Only imported in the ``engine`` session's environment.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import logging
import multiprocessing
import os
import queue
import resource
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from p2pkv.errors import ConfigError
from p2pkv.hookspecs import hookimpl

if TYPE_CHECKING:
    from p2pkv_tools.bench.netns import Placement

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
_COMMAND = "command"
"""The input queue's kind of item that is a test command (the other: vLLM's ``WAKEUP``)."""
_GONE = "gone"
"""The command the input thread queues once the test's end of the pipe closed."""
STEPS_KEPT = 100_000
"""Step durations the host keeps between two ``steps`` commands (the oldest dropped)."""
CHURN_PREFIX = "churn-"
"""Request ids of the ``churn`` stream (its results are not sent to the test)."""


def engine_kwargs(
    model: str, kv_transfer_config: dict[str, Any] | None, engine_args: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``vllm.LLM`` arguments of a small deterministic CPU engine (``engine_args`` added,
    e.g. ``kv_cache_dtype``)."""
    return {
        "model": model,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,
        "kv_cache_memory_bytes": 32 * 1024 * 1024,
        "kv_transfer_config": kv_transfer_config,
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
        labels = ",".join(
            f"{k}={v}"
            for k, v in sorted(metric.labels.items())
            if k not in ("engine", "model_name")
        )
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
    while the answer is pending).

    Inside a load, for every request whose load is open (the engine bench pulls one at a
    time): ``read`` and ``read_end`` (the first ``read_blocks`` call of any data transport,
    the last return: on UCX's ``cma`` lane the copy runs inside it), ``copy`` and
    ``copy_end`` (the staged lane's copies from its pool into the slots,
    ``StagingPool.copy_out``), ``ended`` (the tier saw its last read end: its
    ``p2pkv_transfer_finished`` observer hook), and what those calls took, summed: seconds
    of wall time and of the calling thread's CPU (``read_s``, ``read_cpu_s``, ``copy_s``,
    ``copy_cpu_s``), the thread's page faults (``read_faults``, ``copy_faults``; the
    kernel counts those it took for ``process_vm_readv`` on the other process's pages too)
    and the times it was preempted (``read_preempted``, ``copy_preempted``).
    """

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

        P2PKVTier.lookup = timed_lookup  # type: ignore[method-assign,assignment]
        P2PKVTier.submit_load = timed_submit_load  # type: ignore[method-assign,assignment]
        P2PKVTier.get_finished_jobs = timed_finished  # type: ignore[method-assign,assignment]
        self._watch_loads()

    def _watch_loads(self) -> None:
        """Time the data transports' reads and staged copies, and observe the tier's reads
        end (an observer registered in the process-wide registry the tier will load)."""
        from p2pkv.observers import Observers
        from p2pkv.registry import default_registry

        registry = default_registry()
        registry.pm.register(self, name="engine-bench-pull-clock")
        registry.observers = Observers(registry.pm)
        for name in registry.entries("data"):
            with contextlib.suppress(ConfigError):  # a transport this host has disabled
                self._time(registry.transport("data", name), "read_blocks", "read")
        with contextlib.suppress(ImportError):
            from p2pkv_nixl.staging import StagingPool

            self._time(StagingPool, "copy_out", "copy")

    def _time(self, cls: type[Any], method: str, mark: str) -> None:
        """Wrap ``cls.method``: each call marks every open load (see the class docstring)."""
        original = getattr(cls, method)

        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            began, cpu = time.monotonic(), time.thread_time()
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return original(obj, *args, **kwargs)
            finally:
                ended, used = time.monotonic(), time.thread_time() - cpu
                after = resource.getrusage(resource.RUSAGE_THREAD)
                faults = (after.ru_minflt + after.ru_majflt) - (usage.ru_minflt + usage.ru_majflt)
                added = {
                    f"{mark}_s": ended - began,
                    f"{mark}_cpu_s": used,
                    f"{mark}_faults": faults,
                    f"{mark}_preempted": after.ru_nivcsw - usage.ru_nivcsw,
                }
                for marks in self._open_loads():
                    marks.setdefault(mark, began)
                    marks[f"{mark}_end"] = ended
                    for key, value in added.items():
                        marks[key] = marks.get(key, 0.0) + value

        setattr(cls, method, timed)

    @hookimpl
    def p2pkv_transfer_finished(
        self, peer: str, transfer_id: int, success: bool, nbytes: int, seconds: float
    ) -> None:
        for marks in self._open_loads():
            marks["ended"] = time.monotonic()

    def _open_loads(self) -> list[dict[str, float]]:
        """The marks of each request whose load is open (submitted, result not reported)."""
        return [self.marks.setdefault(req_id, {}) for req_id in set(self._job_requests.values())]

    def _mark(self, req_id: str, mark: str) -> None:
        self.marks.setdefault(req_id, {}).setdefault(mark, time.monotonic())

    def of(self, req_id: str) -> dict[str, float]:
        """The marks of the request the test submitted as ``req_id`` (vLLM may have
        suffixed its id)."""
        return next((marks for key, marks in self.marks.items() if key.startswith(req_id)), {})


class _Times:
    """When each request was added to the engine, first produced an output token, and
    finished (``time.monotonic()`` of this process, taken in the host loop: the first token
    is stamped when the step that sampled it returns)."""

    def __init__(self) -> None:
        self.of: dict[str, dict[str, float]] = {}

    def submitted(self, req_id: str) -> None:
        self.of[req_id] = {"submitted": time.monotonic()}

    def output(self, req_id: str, n_tokens: int, finished: bool) -> None:
        """A step returned ``req_id``'s output with ``n_tokens`` tokens so far."""
        times = self.of.get(req_id)
        if times is None:
            return
        now = time.monotonic()
        if n_tokens and "first_token" not in times:
            times["first_token"] = now
        if finished:
            times["finished"] = now


class _Churn:
    """The engine's own request stream (``churn`` command): keeps ``inflight`` requests of
    the queued prompts in flight, greedy, one output token each."""

    def __init__(self) -> None:
        self.inflight = 0
        self.params: Any = None
        """The ``kv_transfer_params`` of the stream's requests."""
        self.queue: collections.deque[list[int]] = collections.deque()
        self.active = 0
        self.finished = 0
        self.serial = 0

    def configure(
        self, inflight: int, prompts: Sequence[Sequence[int]], params: Any = None
    ) -> None:
        """Keep ``inflight`` in flight from now on (0: drop the queue); queue ``prompts``;
        requests submitted from now on carry ``params``."""
        self.inflight, self.params = max(0, inflight), params
        if not self.inflight:
            self.queue.clear()
        self.queue.extend(list(p) for p in prompts)

    def due(self) -> list[tuple[str, list[int]]]:
        """The requests to submit now (ids and prompts) to fill the stream up."""
        out = []
        while self.active < self.inflight and self.queue:
            out.append((f"{CHURN_PREFIX}{self.serial}", self.queue.popleft()))
            self.serial += 1
            self.active += 1
        return out

    def done(self) -> None:
        self.active -= 1
        self.finished += 1

    def status(self) -> tuple[int, int, int]:
        return self.finished, self.active, len(self.queue)


class _Host:
    def __init__(
        self, conn: Connection, model: str, kv_transfer_config: Any, engine_args: dict[str, Any]
    ) -> None:
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
        self.times = _Times()
        self.churn = _Churn()
        self.steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=STEPS_KEPT)
        self.scheduled = 0
        """Tokens the scheduler gave the model in the current step."""
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        """The test's commands and vLLM's ``WAKEUP`` requests (the P2P tier's idle watcher
        finds this queue on the stack of ``has_pending_work``, as in vLLM's engine core)."""
        self._count_scheduled()

    def _count_scheduled(self) -> None:
        """Wrap this engine's ``scheduler.schedule`` (instance attribute only) to keep the
        tokens each step schedules."""
        scheduler = self.core.scheduler
        schedule = scheduler.schedule

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.scheduled += int(getattr(out, "total_num_scheduled_tokens", 0) or 0)
            return out

        scheduler.schedule = counted

    def submit(self, req_id: str, prompt: list[int], max_tokens: int, params: Any) -> None:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": params} if params else None
        sampling = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra
        )  # random weights: EOS means nothing
        self.llm.llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, sampling)
        self.times.submitted(req_id)

    def configure_churn(
        self, inflight: int, prompts: Sequence[Sequence[int]], params: Any = None
    ) -> None:
        """The ``churn`` command: reconfigure the stream, then fill it up."""
        self.churn.configure(inflight, prompts, params)
        self.fill_churn()

    def fill_churn(self) -> None:
        """Submit what the stream is due (its requests keep no times)."""
        for req_id, prompt in self.churn.due():
            self.submit(req_id, prompt, 1, self.churn.params)
            del self.times.of[req_id]  # not the test's: no times kept

    def step(self) -> None:
        """One engine step (timed, its scheduled tokens kept); the stream's finished requests
        replaced, the test's reported."""
        began, self.scheduled = time.monotonic(), 0
        outputs = self.llm.llm_engine.step()
        self.steps.append((time.monotonic() - began, self.scheduled))
        for out in outputs:
            if out.request_id.startswith(CHURN_PREFIX):
                if out.finished:
                    self.churn.done()
                    self.fill_churn()
                continue
            self.times.output(out.request_id, len(out.outputs[0].token_ids), out.finished)
            if out.finished:
                self.conn.send(
                    ("done", out.request_id, list(out.outputs[0].token_ids), out.num_cached_tokens)
                )

    def take_steps(self) -> list[tuple[float, int]]:
        """The steps since the last call (cleared): seconds and scheduled tokens each."""
        steps = list(self.steps)
        self.steps.clear()
        return steps

    def loading(self) -> int:
        manager = self.core.scheduler.connector.connector_scheduler.manager
        jobs = manager._transfer_jobs.values()  # 0.32: (TransferJob, tier); 0.27.1: the job
        return sum(getattr(job, "transfer_job", job).is_promotion for job in jobs)

    def has_work(self) -> bool:
        """Whether the engine must step (vLLM's ``EngineCore.has_work``): requests, or
        pending connector work (the P2P tier's ``has_pending_work``)."""
        return bool(self.core.scheduler.has_requests())

    def command(self, cmd: tuple[Any, ...]) -> bool:
        """Carry out one command of the test; False once the host must end."""
        conn = self.conn
        if cmd[0] == "submit":
            self.submit(*cmd[1:])
        elif cmd[0] == "metrics":
            conn.send(("metrics", metric_values(self.llm.get_metrics())))
        elif cmd[0] == "exposition":
            import prometheus_client

            conn.send(("exposition", prometheus_client.generate_latest().decode()))
        elif cmd[0] == "loading":
            conn.send(("loading", self.loading()))
        elif cmd[0] == "log":
            conn.send(("log", list(self.log.lines)))
        elif cmd[0] == "marks":
            conn.send(("marks", self.clock.of(cmd[1])))
        elif cmd[0] == "times":
            conn.send(("times", dict(self.times.of.get(cmd[1], {}))))
        elif cmd[0] == "churn":
            self.configure_churn(*cmd[1:])
            conn.send(("churn", *self.churn.status()))
        elif cmd[0] == "steps":
            conn.send(("steps", self.take_steps()))
        elif cmd[0] == "shutdown":
            conn.send(("down", self.shutdown()))
            return False
        elif cmd[0] == _GONE:
            self.shutdown()
            return False
        return True

    def run(self) -> None:
        """vLLM's engine-core busy loop (``EngineCoreProc.run_busy_loop``): while the engine
        has no work, block on the input queue (the test's commands, and the P2P tier's
        ``WAKEUP``, a no-op that only ends the wait); then take what else is queued, and
        step."""
        while True:
            while not self.has_work():
                if not self._handle(_next_input(self.input_queue)):
                    return
            while not self.input_queue.empty():
                if not self._handle(self.input_queue.get_nowait()):
                    return
            self.step()

    def _handle(self, item: tuple[Any, Any]) -> bool:
        kind, cmd = item
        return self.command(cmd) if kind == _COMMAND else True  # else vLLM's WAKEUP

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


def llm_host(
    conn: Connection,
    model: str,
    kv_transfer_config: Any,
    env: dict[str, str],
    engine_args: dict[str, Any] | None = None,
    placement: Placement | None = None,
) -> None:
    """Child entry point: build the engine, then serve commands until ``shutdown``. With a
    ``placement`` (``p2pkv_tools.bench.netns``) the process first enters that network namespace,
    whose environment (``UCX_TLS``, ``UCX_NET_DEVICES``) goes over ``ENGINE_ENV`` and
    ``env``; a failure to enter it is the ``failed`` reply."""
    os.environ.update({**ENGINE_ENV, **env})
    if (engine_args or {}).get("tensor_parallel_size", 1) > 1:
        # the test's engine processes are daemons, which may not start the TP workers
        multiprocessing.current_process().daemon = False
    try:
        if placement is not None:
            from p2pkv_tools.bench.netns import enter

            enter(placement)  # before vLLM starts a thread or opens a socket
        register_test_tiers(kv_transfer_config)
        host = _Host(conn, model, kv_transfer_config, engine_args or {})
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise
    conn.send(("ready",))
    threading.Thread(
        target=_read_commands, args=(conn, host.input_queue), name="llm-host-commands", daemon=True
    ).start()
    host.run()


def _read_commands(conn: Connection, inbox: queue.Queue[tuple[Any, Any]]) -> None:
    """The host's input thread (vLLM's engine core has one too): the test's commands into
    the input queue, until ``shutdown`` or the pipe closes (then ``_GONE``)."""
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):  # the test went away
            inbox.put((_COMMAND, (_GONE,)))
            return
        inbox.put((_COMMAND, cmd))
        if cmd[0] == "shutdown":
            return


def _next_input(inbox: queue.Queue[tuple[Any, Any]]) -> tuple[Any, Any]:
    """The next input, however long the engine sleeps: the input thread always ends with
    ``shutdown`` or ``_GONE``, so this wait ends too."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            continue
