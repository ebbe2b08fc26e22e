"""The vllm runtime's main process: what the host's runtime client talks to over fd 3.

It owns an engine (wsync.vllm.runtime.engine.VllmEngine: ``vllm.LLM`` and its TP workers) and keeps
the runtime's state the way the reference runtime does (scripts/wsync/runtime/reference.lua):
the committed model version, the publication being updated, the header it checked, and
whether it broke. A failure that leaves the engine in doubt (a failed weight command, a
lost worker) is fatal: the answer says so, the host destroys this process's tree, and any
later command is refused until then. Generation is refused between start and finish; each
result is stamped with the model version committed when its request was dispatched.

Generation either waits for its outputs (``generate``) or streams (``submit``, ``poll``:
wsync.vllm.runtime.streams), the engine stepping between commands (Server.idle) whenever
generation may run; ``pause`` / ``resume`` abort, finish or hold the requests in flight in
vLLM's modes.
"""
from __future__ import annotations

import os
import resource
import time
from typing import Any, Optional, Protocol

from .. import protocol
from ..contract import check_header, check_receipts
from .engine import SAMPLING_KEYS
from ..failure import Failure
from .server import Server
from .streams import Streams

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


class Engine(Protocol):
    """What the runtime needs of the rollout engine behind it. Every method that touches the
    workers raises Failure (fatal when the engine is in doubt afterwards, with the TP rank
    when one is to blame)."""

    backend: str
    transport: str

    def workers(self) -> list[dict[str, Any]]:
        """Each TP worker, by rank: {rank, pid, device: {uuid, index}}."""

    def state(self) -> dict[str, str]:
        """{weights, kv_cache}: "awake", "offloaded" or "discarded"; "reserved" or "free"."""

    def sleep(self, level: int) -> None: ...

    def wake(self, tags: list[str]) -> None: ...

    def init_weights(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Imports the packed buffers of every TP rank (payload["buffers"][rank]) once and
        makes what its load mode needs; the workers' results by rank."""

    def start_update(self, header: dict[str, Any]) -> None: ...

    def load_chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Loads chunk payload["chunk"] from buffer slot payload["buffer"]; by rank,
        {rank, tensors, bytes, copy_seconds}."""

    def finish_update(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        """Ends the update; each worker's receipt by rank (wsync.vllm.worker.receipts)."""

    def commit(self, model_version: int, preempt: bool = False, in_flight: bool = False) -> Optional[str]:
        """Serves ``model_version`` from now on: no request added later reads a prefix cached
        under earlier weights; ``preempt``: the requests held across the publication are to
        recompute their KV cache; ``in_flight``: requests are still in the engine. How the
        prefix cache was dropped ("salted": later requests hash apart; "reset")."""

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Per prompt: {token_ids, logprobs} (the sampled tokens' log-probabilities)."""

    def close(self) -> None: ...

    # Streaming (wsync.vllm.runtime.streams):
    def stream_add(self, request_id: int, prompt: list[int], sampling: dict[str, Any]) -> None:
        """Queues a request (refused with a non-fatal Failure when the engine will not take it)."""

    def stream_step(self) -> list[dict[str, Any]]:
        """The new tokens of one engine step: [{id, token_ids, logprobs, finished, finish}]."""

    def stream_abort(self, ids: list[int]) -> None: ...

    def stream_hold(self) -> list[dict[str, Any]]:
        """Holds every request; what they produced before the hold took effect (as stream_step)."""

    def stream_release(self) -> None: ...


def _memory() -> dict[str, int]:
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {"rss_bytes": resident_pages * resource.getpagesize(), "pid": os.getpid()}


class Runtime:
    """The runtime's state and its command handlers (the host's wsync.control.client is the
    other end)."""

    name = "vllm runtime"

    def __init__(self, engine: Engine, tp: int, load: str, version: str = "") -> None:
        self.engine, self.tp, self.load, self.version = engine, tp, load, version
        self.model_version = 0
        self.update: Optional[dict[str, Any]] = None
        self.expected_resident: Optional[list[int]] = None
        self.initialized = False
        self.transport: Optional[str] = None
        self.broken: Optional[Failure] = None
        self.prefix_cache_resets = 0
        self.generated = 0
        self.streams = Streams(engine, lambda: self.model_version)

    # Failures -----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.broken is not None:
            raise Failure("RUNTIME_BROKEN", f"the runtime broke earlier and serves nothing: {self.broken.message}",
                          fatal=True, rank=self.broken.rank)

    def _engine_call(self, what: str, call: Any, *args: Any) -> Any:
        """Runs an engine call that must not fail: any failure breaks the runtime."""
        try:
            return call(*args)
        except Failure as failed:
            if failed.fatal:
                self.broken = failed
            raise
        except Exception as error:
            self.broken = Failure("WORKER_FAILED", f"{what}: {type(error).__name__}: {error}", fatal=True)
            raise self.broken from error

    # State ----------------------------------------------------------------------------

    def info(self, _payload: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        self._check_alive()
        state = self.engine.state()
        workers = [dict(worker, state=state) for worker in self.engine.workers()]
        return {
            "protocol": protocol.VERSION,
            "runtime": "vllm",
            "load": self.load,
            "version": self.version,
            "pid": os.getpid(),
            "tp_world": self.tp,
            "backend": self.engine.backend,
            "capabilities": {"generate": True, "stream": True, "sleep_levels": list(SLEEP_LEVELS),
                             "wake_tags": list(WAKE_TAGS)},
            "state": state,
            "workers": workers,
            "model_version": self.model_version,
            "updating": self.update is not None,
            "prefix_cache_resets": self.prefix_cache_resets,
        }

    def sleep(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        if self.update is not None:
            raise Failure("STATE_REFUSED", "cannot sleep during a weight update")
        level = payload.get("level")
        if level not in SLEEP_LEVELS:
            raise Failure("INVALID_ARGUMENT", f"sleep level must be 1 or 2, got {level}")
        if self.streams.in_flight():
            # (A sleep takes the KV cache: vLLM's own sleep aborts them too.)
            self._engine_call("sleep", self.streams.abort_all)
        self._engine_call(f"sleep level {level}", self.engine.sleep, level)
        return self.info()

    def wake(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        tags = payload.get("tags")
        if tags == {}:  # (an empty Lua table arrives as an object)
            tags = []
        if not isinstance(tags, list) or not tags or any(tag not in WAKE_TAGS for tag in tags):
            raise Failure("INVALID_ARGUMENT", f"wake tags must be a non-empty list of {', '.join(WAKE_TAGS)}; "
                          f"got {tags!r}")
        self._engine_call(f"wake {tags}", self.engine.wake, tags)
        return self.info()

    # Generation -----------------------------------------------------------------------

    def pause(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Pauses generation (vLLM's modes abort, wait, keep): the requests in flight are
        aborted, finished or held (wsync.vllm.runtime.streams)."""
        self._check_alive()
        mode, kv = payload.get("mode"), payload.get("kv")
        return self._engine_call(f"pause ({mode})", self.streams.pause, mode, kv)

    def resume(self, _payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        return self._engine_call("resume", self.streams.resume)

    def _generation_allowed(self, held: bool = False) -> Optional[str]:
        """Why generation cannot run now (paused, unless ``held``: requests submitted while
        paused wait for resume; an update; weights or KV cache asleep), or None."""
        paused = self.streams.paused
        if paused is not None and not held:
            return f"generation is paused ({paused['mode']}): resume first"
        if self.update is not None:
            return (f"no generation during a weight update (publication {self.update['publication_id']} is between "
                    "start and finish)")
        state = self.engine.state()
        if state.get("weights") != "awake" or state.get("kv_cache") != "reserved":
            return (f"generation needs the weights awake and the KV cache reserved; weights are "
                    f"{state.get('weights')}, the KV cache is {state.get('kv_cache')}")
        return None

    def submit(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Queues streaming requests; while paused they wait for resume."""
        self._check_alive()
        why = self._generation_allowed(held=True)
        if why:
            raise Failure("STATE_REFUSED", why)
        ids = self._engine_call("submit", self.streams.submit, payload.get("requests"), SAMPLING_KEYS)
        return {"ids": ids}

    def poll(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        return {"requests": self.streams.poll(payload.get("ids")), "in_flight": self.streams.in_flight()}

    def idle(self) -> bool:
        """Between commands: one engine step for the streaming requests when generation may
        run; whether there is more to do at once. A failing step breaks the runtime (the
        next command says so)."""
        if self.broken is not None or not self.streams.active:
            return False
        if self._generation_allowed() is not None:
            return False
        try:
            return self._engine_call("generation step", self.streams.step)
        except Failure:
            return False

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        why = self._generation_allowed()
        if why:
            raise Failure("STATE_REFUSED", why)
        if self.streams.in_flight():
            raise Failure("STATE_REFUSED", f"generate while {self.streams.in_flight()} streaming requests are in "
                          "flight (poll them to their end first)")
        prompts = payload.get("prompts", [])
        if prompts == {}:
            prompts = []
        if not isinstance(prompts, list) or not all(
                isinstance(prompt, list) and prompt and all(isinstance(token, int) and token >= 0 for token in prompt)
                for prompt in prompts):
            raise Failure("INVALID_ARGUMENT", "generate: prompts must be a list of non-empty lists of token ids")
        sampling = payload.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise Failure("INVALID_ARGUMENT", "generate: sampling must be an object of sampling parameters")
        # The version committed when the requests are dispatched: no update can start
        # while this command runs (one request in flight per connection).
        version = self.model_version
        started = time.perf_counter()
        outputs = self._engine_call("generate", self.engine.generate, prompts, sampling) if prompts else []
        # (engine_seconds: the engine's own time, vLLM's LLM.generate; the rest of what the
        # caller waited is wsync's path.)
        engine_seconds = time.perf_counter() - started
        self.generated += len(outputs)
        for output in outputs:
            output["model_version"] = version
        return {"model_version": version, "outputs": outputs, "engine_seconds": engine_seconds}

    # Weight transfer ------------------------------------------------------------------

    def init_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        if self.update is not None:
            raise Failure("STATE_REFUSED", "init_weights during an update", fatal=True)
        if payload.get("tp") != self.tp:
            raise Failure("TOPOLOGY", f"init_weights for TP {payload.get('tp')} sent to a runtime of TP {self.tp}",
                          fatal=True)
        if payload.get("transport") != self.engine.transport:
            raise Failure("TRANSPORT", f"init_weights for transport {payload.get('transport')}; this runtime's "
                          f"workers move weights over {self.engine.transport}", fatal=True)
        buffers = payload.get("buffers")
        if not isinstance(buffers, list) or len(buffers) != self.tp:
            raise Failure("BAD_METADATA", f"init_weights needs the packed buffers of each of the {self.tp} TP ranks",
                          fatal=True)
        gates = payload.get("gates")
        if gates is not None and (not isinstance(gates, list) or len(gates) != self.tp):
            raise Failure("BAD_METADATA", f"init_weights needs the gate of each of the {self.tp} TP ranks",
                          fatal=True)
        results = self._engine_call("init_weights", self.engine.init_weights, payload)
        self.initialized, self.transport = True, payload["transport"]
        # (``ordered``: every worker mapped its rank's gate, so chunks may be ordered on the
        # device; the direct loader's workers do, vLLM's own receiver does not.)
        ordered = gates is not None and all(result.get("ordered") is True for result in results)
        return {"workers": results, "ordered": ordered}

    def check_header(self, header: Any) -> None:
        """A header must match this runtime (wsync.vllm.contract.check_header): its protocol,
        transport, committed version, TP world and the workers' devices in order."""
        uuids = [worker["device"]["uuid"] for worker in sorted(self.engine.workers(), key=lambda w: w["rank"])]
        check_header(header, {"protocol": protocol.VERSION, "transport": self.transport,
                              "committed": self.model_version, "tp_world": self.tp, "uuids": uuids})

    def start_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        if not self.initialized:
            raise Failure("NOT_INITIALIZED", "start_update before init_weights", fatal=True)
        if self.update is not None:
            raise Failure("STATE_REFUSED", f"start_update while publication {self.update['publication_id']} is "
                          "being updated", fatal=True)
        header = payload.get("header")
        self.check_header(header)
        if self.engine.state().get("weights") != "awake":
            raise Failure("STATE_REFUSED", f"cannot update weights that are {self.engine.state().get('weights')}: "
                          "wake weights first", fatal=True)
        self._engine_call("start_update", self.engine.start_update, header)
        resident = header.get("resident_tensors")
        self.expected_resident = resident if isinstance(resident, list) else None
        self.update = header
        return {}

    def load_chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        if self.update is None:
            raise Failure("NOT_UPDATING", "load_chunk outside an update", fatal=True)
        results = self._engine_call(f"load_chunk {payload.get('chunk')}", self.engine.load_chunk, payload)
        return {
            "chunk": payload.get("chunk"),
            "bytes": sum(int(result["bytes"]) for result in results),
            # (the slowest worker's copy: they load at once)
            "copy_seconds": max((float(result.get("copy_seconds", 0)) for result in results), default=0.0),
        }

    def finish_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        header = self.update
        if header is None:
            raise Failure("NOT_UPDATING", "finish_update without start_update", fatal=True)
        if payload.get("publication_id") != header["publication_id"] or \
                payload.get("model_version") != header["model_version"]:
            raise Failure("WRONG_PUBLICATION", f"finish_update for publication {payload.get('publication_id')} "
                          f"version {payload.get('model_version')}; this runtime is updating publication "
                          f"{header['publication_id']} version {header['model_version']}", fatal=True)
        receipts = self._engine_call("finish_update", self.engine.finish_update, header)
        self.update = None
        try:
            check_receipts(header, receipts, self.expected_resident)
        except Failure as failed:
            self.broken = failed
            raise
        # Commit: the version is served from now on; no request reads a prefix cached with
        # the old weights (engine.commit: "salted" or "reset").
        started = time.perf_counter()
        how = self._engine_call("commit", self.engine.commit, header["model_version"], self.streams.held_across(),
                                self.streams.in_flight() > 0)
        commit_seconds = time.perf_counter() - started
        self.model_version = header["model_version"]
        self.prefix_cache_resets += 1
        answer = {"model_version": self.model_version, "receipts": receipts, "prefix_cache_reset": True,
                  "prefix_cache": how, "commit_seconds": commit_seconds}
        if payload.get("release") is True:
            # (The buffer policy's release in the same answer: no worker reads a buffer
            # outside an update, and the buffers stay mapped, "keep".)
            answer["released"] = True
        return answer

    def release(self, _payload: dict[str, Any]) -> dict[str, Any]:
        self._check_alive()
        if self.update is not None:
            raise Failure("STATE_REFUSED", "release during an update", fatal=True)
        return {"workers": [{"rank": worker["rank"]} for worker in self.engine.workers()]}

    def resident_values(self, _payload: dict[str, Any]) -> dict[str, Any]:
        """Each worker's values sums of its resident tensors (verify = "values"), by rank."""
        self._check_alive()
        if self.update is not None:
            raise Failure("STATE_REFUSED", "resident_values during an update")
        return {"workers": self._engine_call("resident_values", self.engine.resident_values)}

    def process_memory(self, _payload: dict[str, Any]) -> dict[str, Any]:
        return {"main": _memory(), "workers": []}

    def handlers(self, server: Server) -> dict[str, Any]:
        """The commands this runtime answers (and its generation steps between them:
        ``server.idle``)."""
        server.idle = self.idle
        def shutdown(_payload: dict[str, Any]) -> dict[str, Any]:
            def close() -> None:
                server.closed = True
            self.engine.close()
            server.after_answer = close
            return {}

        def not_supported(what: str) -> Any:
            def refuse(_payload: dict[str, Any]) -> dict[str, Any]:
                self._check_alive()
                raise Failure("NOT_SUPPORTED", f"the vllm runtime has no {what}; use verify = false, or the "
                              "reference runtime for checks against wsync's synthetic values")
            return refuse

        return {
            "info": self.info, "sleep": self.sleep, "wake": self.wake, "generate": self.generate,
            "pause": self.pause, "resume": self.resume, "submit": self.submit, "poll": self.poll,
            "init_weights": self.init_weights, "start_update": self.start_update, "load_chunk": self.load_chunk,
            "finish_update": self.finish_update, "release": self.release, "process_memory": self.process_memory,
            "shutdown": shutdown,
            "resident_checksums": not_supported("checksums of its resident tensors"),
            "resident_check": not_supported("check of its resident tensors against synthetic values"),
            "resident_values": self.resident_values if hasattr(self.engine, "resident_values")
            else not_supported("values sums of its resident tensors"),
        }
