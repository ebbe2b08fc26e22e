"""The engine behind the vllm runtime: ``vllm.LLM`` with wsync's worker extension.

The runtime (wsync.vllm.runtime) keeps versions, headers and receipts; this module turns its
calls into vLLM's: sleep and wake with tags, ``collective_rpc`` to every TP worker's
extension (wsync.vllm.worker.extension) for the weight commands, the prefix-cache reset at commit,
and generation from token ids with the sampled tokens' log-probabilities.

vLLM is imported here, when the engine starts (15-25 s), never by the package, and only
through wsync.vllm.compat, which checks its version and reads what vLLM's documented
``LLM`` API does not give.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from .. import compat
from ..failure import Failure, fault_items

#: What vLLM 0.26's LLM needs for wsync; a recipe's ``runtime.vllm`` may not set these.
FIXED_ARGUMENTS = ("model", "tensor_parallel_size", "enable_sleep_mode", "weight_transfer_config",
                   "worker_extension_cls")

#: Sampling parameters generate passes on to vLLM's SamplingParams (anything else is refused).
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop_token_ids",
                 "ignore_eos", "prompt_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _children(pid: int) -> list[int]:
    """The pids of the live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is no zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_R = TypeVar("_R")

#: How often a call into vLLM looks whether its engine still lives (seconds).
WATCH_INTERVAL = 0.2


def _faults() -> dict[str, str]:
    """$WSYNC_VLLM_FAULT, for the GPU tier's fault tests: "kind@where,...", where a command
    name and optionally its chunk ("load_chunk#2"). Kinds: kill_engine (SIGKILL to this
    process's children, vLLM's EngineCore, before the command), bad_receipt (TP rank 0's
    receipt names another manifest)."""
    items = fault_items(os.environ.get("WSYNC_VLLM_FAULT", ""), ("kill_engine", "bad_receipt"), "vLLM fault",
                        " (want KIND@CMD[#CHUNK], KIND kill_engine or bad_receipt)")
    return {item["cmd"] + ("" if item["nth"] is None else f"#{item['nth']}"): item["kind"] for item in items}


def _inner(timeout: float) -> float:
    """A little less than the host gives the command, so that the hop that stopped answering is
    the one named (wsync.control.client.inner_timeouts)."""
    return max(timeout - 1, timeout * 0.8)


class Caller:
    """Runs blocking calls into vLLM, one at a time, on a daemon thread of its own, while
    the calling thread looks every WATCH_INTERVAL whether the engine died (``dead()``
    names what died, or None) and then fails at once with ENGINE_DIED: vLLM 0.26's client
    waits for a dead EngineCore's answer forever (a utility call has no timeout on the
    client's side). One thread for every call (each generation step among them), not one
    made per call; a call that never returns stays on it, but the engine is dead then and
    the runtime broken."""

    def __init__(self, dead: Callable[[], Optional[str]]) -> None:
        self.dead = dead
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="wsync-vllm-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, done, outcome = self.calls.get()
            try:
                outcome["value"] = call()
            except BaseException as error:  # re-raised in the caller's thread
                outcome["error"] = error
            done.set()

    def __call__(self, what: str, call: Callable[[], _R]) -> _R:
        done = threading.Event()
        outcome: dict[str, Any] = {}
        self.calls.put((call, done, outcome))
        while not done.wait(WATCH_INTERVAL):
            dead = self.dead()
            if dead:
                raise Failure("ENGINE_DIED", f"{dead} during {what}", fatal=True)
        if "error" in outcome:
            dead = self.dead()
            if dead:
                raise Failure("ENGINE_DIED", f"{dead} during {what}: {outcome['error']}", fatal=True)
            raise outcome["error"]
        return outcome["value"]


class VllmEngine:
    transport = "cuda_ipc"

    def __init__(self, tp: int, devices: list[int], backend: str, model: str, load: str,
                 engine_args: dict[str, Any], timeouts: dict[str, float]) -> None:
        if backend != "cuda":
            raise Failure("RUNTIME_START", f"vLLM runs on the cuda backend, not {backend}")
        fixed = sorted(set(engine_args) & set(FIXED_ARGUMENTS))
        if fixed:
            raise Failure("RUNTIME_START", f"runtime.vllm sets {', '.join(fixed)}, which wsync sets itself")
        self.backend, self.tp, self.load, self.timeouts = backend, tp, load, timeouts
        self._vllm = compat.vllm()
        arguments = dict(engine_args)
        arguments.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = self._vllm.LLM(model=model, tensor_parallel_size=tp, enable_sleep_mode=True,
                                 weight_transfer_config=compat.ipc_weight_transfer_config(),
                                 worker_extension_cls="wsync.vllm.worker.extension.WorkerExtension", **arguments)
        # (The EngineCore's processes, or else this process's children: the EngineCore is one.)
        self._engine_pids = compat.engine_core_pids(self.llm) or _children(os.getpid())
        self._identities: list[dict[str, Any]] = []
        self._watched = Caller(self._dead)
        compat.init_ipc_weight_transfer(self.llm)
        self._identities = self._watched("startup", lambda: self.llm.collective_rpc(
            "wsync_identity", timeout=_inner(timeouts.get("startup", 600))))
        order = [identity["rank"] for identity in self._identities]
        if order != list(range(tp)):
            raise Failure("RUNTIME_START", f"vLLM's TP workers answered as ranks {order}, not 0..{tp - 1} in order")
        self._state = {"weights": "awake", "kv_cache": "reserved"}
        self._closed = False
        self._faults = _faults()
        # Per weight command, each call's (seconds in collective_rpc or the channel, the
        # slowest worker's seconds, that worker's parts of them by name).
        self._timing: dict[str, list[tuple[float, float, dict[str, float]]]] = {}
        self._salt = "wsync-v0"  # (the committed version's cache salt: commit)
        # (Set by the runtime's command line: when the direct loader is checked against
        # vLLM's own; how weight commands reach the workers, "socket" or "rpc".)
        self.check, self.channel = "first", "socket"
        self._channels: Any = None
        self._channel_dir: Optional[str] = None

    def _dead(self) -> Optional[str]:
        """Which of vLLM's processes died (EngineCore, a TP worker), or None."""
        for pid in self._engine_pids:
            if not _alive(pid):
                return f"vLLM's EngineCore (pid {pid}) died"
        for identity in self._identities:
            if not _alive(identity["pid"]):
                return f"vLLM's TP worker {identity['rank']} (pid {identity['pid']}) died"
        if compat.engine_dead(self.llm):
            return "vLLM's EngineCore died"
        return None

    def _inject(self, where: str) -> None:
        if self._faults.get(where) == "kill_engine":
            for child in _children(os.getpid()):
                os.kill(child, signal.SIGKILL)

    def workers(self) -> list[dict[str, Any]]:
        return [{"rank": identity["rank"], "pid": identity["pid"], "device": identity["device"],
                 "resident_parameters": identity["resident_tensors"]} for identity in self._identities]

    def state(self) -> dict[str, str]:
        return dict(self._state)

    def sleep(self, level: int) -> None:
        self._watched("sleep", lambda: self.llm.sleep(level=level))
        # (vLLM's sleep frees its pools; what torch's allocator keeps cached in each worker
        # goes back to the driver too, for the trainer that runs next.)
        self._watched("sleep", lambda: self.llm.collective_rpc("wsync_release_cache"))
        offloaded = level == 1 and self._state["weights"] == "awake"
        self._state = {"weights": "offloaded" if offloaded else "discarded", "kv_cache": "free"}

    def wake(self, tags: list[str]) -> None:
        self._watched("wake", lambda: self.llm.wake_up(tags=tags))
        if "weights" in tags:
            self._state["weights"] = "awake"
        if "kv_cache" in tags:
            self._state["kv_cache"] = "reserved"

    def _open_channels(self) -> None:
        """The channel to every TP worker (``channel = "socket"``: wsync.vllm.runtime.channels)."""
        from .channels import Channels
        self._channel_dir = tempfile.mkdtemp(prefix="wsync-vllm-")
        paths = self._watched("channel", lambda: self.llm.collective_rpc("wsync_channel", args=(self._channel_dir,)))
        self._channels = Channels(paths)

    def _command(self, cmd: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        timeout = _inner(self.timeouts.get(cmd, self.timeouts.get("default", 60)))
        started = time.perf_counter()
        if self.channel == "socket":
            if self._channels is None:
                self._open_channels()
            answers = self._channels.call(cmd, json.dumps(payload), timeout, self._dead)
        else:
            answers = self._watched(cmd, lambda: self.llm.collective_rpc("wsync_command", timeout=timeout,
                                                                        args=(cmd, json.dumps(payload))))
        seconds = time.perf_counter() - started
        results, slowest, parts = [], 0.0, {}
        for rank, text in enumerate(answers):
            answer = json.loads(text)
            if float(answer.get("seconds", 0.0)) >= slowest:
                slowest, parts = float(answer.get("seconds", 0.0)), answer.get("parts") or {}
            if not answer.get("ok"):
                error = answer.get("error") or {}
                message = str(error.get("message"))
                if not message.startswith(f"TP worker {rank}"):
                    message = f"TP worker {rank}: {message}"
                raise Failure(error.get("code", "WORKER_FAILED"), message, fatal=error.get("fatal", True), rank=rank)
            results.append(answer["result"])
        self._timing.setdefault(cmd, []).append((seconds, slowest, parts))
        return results

    def timing_summary(self) -> str:
        """Per weight command: calls, median ms in collective_rpc (or the channel) and in the
        slowest worker (the difference is the trip between this process and its workers),
        the medians of the parts the worker named, and the first call's, which plans and
        maps."""
        def median(values: list[float]) -> float:
            return sorted(values)[len(values) // 2] * 1e3

        way = "the channel" if self.channel == "socket" else "collective_rpc"
        lines = []
        for cmd, calls in self._timing.items():
            names = sorted({name for call in calls for name in call[2]})
            named = "".join(f", {name} {median([float(call[2].get(name, 0.0)) for call in calls]):.2f}"
                            for name in names)
            lines.append(f"{cmd} x{len(calls)}: median {median([call[0] for call in calls]):.2f} ms per call in "
                         f"{way}, {median([call[1] for call in calls]):.2f} in the workers{named} (first "
                         f"{calls[0][0] * 1e3:.2f}, {calls[0][1] * 1e3:.2f})")
        return "; ".join(lines) or "no weight commands"

    def init_weights(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        return self._command("init_weights", dict(payload, load=self.load, check=self.check))

    def start_update(self, header: dict[str, Any]) -> None:
        self._command("start_update", {"header": header})

    def load_chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self._inject(f"load_chunk#{payload.get('chunk')}")
        return self._command("load_chunk", payload)

    def finish_update(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        self._inject("finish_update")
        receipts = self._command("finish_update", {"publication_id": header["publication_id"],
                                                   "model_version": header["model_version"]})
        if self._faults.get("finish_update") == "bad_receipt":
            receipts[0]["manifest"] = "f" * 64
        return receipts

    def resident_values(self) -> list[dict[str, Any]]:
        if self.load != "direct":
            raise Failure("NOT_SUPPORTED", "the values check reads vLLM's parameters through wsync's loader: "
                          "load = \"direct\" only")
        return self._command("resident_values", {})

    def commit(self, model_version: int, preempt: bool = False, in_flight: bool = False) -> str:
        """Serves ``model_version`` from now on: every request added later carries its cache
        salt, so none hits a block hashed under earlier weights (vLLM 0.26 hashes the salt into
        a request's first block, and so into every block after it). No walk over the KV
        blocks: vLLM's ``reset_prefix_cache`` visits every block in Python, about 50 ns each,
        which is 100-150 ms at a small model's millions of blocks. Only requests still in the
        engine need vLLM's reset: held across the publication (``preempt``), they are
        preempted and their KV cache recomputed under the new weights at resume. How the
        prefix cache was dropped: "salted" or "reset"."""
        self._salt = f"wsync-v{model_version}"
        if not preempt and not in_flight:
            return "salted"
        reset = self._watched("commit", lambda: self.llm.reset_prefix_cache(reset_running_requests=preempt))
        if reset is False:
            message = ("vLLM did not reset its prefix cache at the commit of version "
                       f"{model_version} (requests still hold KV cache computed under the old weights)")
            if preempt:
                raise Failure("WORKER_FAILED", message, fatal=True)
            print(f"wsync vllm runtime: warning: {message}", file=sys.stderr, flush=True)
        return "reset"

    def _prompt(self, tokens: list[int]) -> Any:
        """A request's prompt, salted with the committed version (see commit)."""
        return self._vllm.TokensPrompt(prompt_token_ids=tokens, cache_salt=self._salt)

    # Streaming (wsync.vllm.runtime.streams): vLLM's own engine loop, a step per call; a pause
    # holds the requests in vLLM's scheduler (sleep level 0, mode "keep").

    @staticmethod
    def _request_id(request_id: int) -> str:
        return f"wsync-{request_id}"

    def stream_add(self, request_id: int, prompt: list[int], sampling: dict[str, Any]) -> None:
        try:
            params = self._vllm.SamplingParams(logprobs=0, output_kind=compat.delta_output_kind(), **sampling)
            self._watched("submit", lambda: compat.add_request(self.llm, self._request_id(request_id),
                                                               self._prompt(prompt), params))
        except (ValueError, TypeError) as error:  # (vLLM's refusal of a request: the engine is fine)
            raise Failure("INVALID_ARGUMENT", f"vLLM refuses it: {error}") from None

    @staticmethod
    def _deltas(outputs: list[Any]) -> list[dict[str, Any]]:
        found = []
        for output in outputs:
            name = str(output.request_id)
            if not name.startswith("wsync-"):
                continue
            completion = output.outputs[0]
            found.append({"id": int(name.split("-", 1)[1]), "token_ids": list(completion.token_ids),
                          "logprobs": _sampled_logprobs(completion),
                          "finished": bool(output.finished), "finish": completion.finish_reason})
        return found

    def stream_step(self) -> list[dict[str, Any]]:
        return self._deltas(self._watched("generation step", lambda: compat.engine_step(self.llm)))

    def stream_abort(self, ids: list[int]) -> None:
        names = [self._request_id(request_id) for request_id in ids]
        self._watched("abort", lambda: compat.abort_requests(self.llm, names))

    def stream_hold(self) -> list[dict[str, Any]]:
        # vLLM answers once its EngineCore sent everything it produced; what reached this
        # process is then read without blocking (vLLM 0.26's client keeps it in a queue).
        self._watched("pause", lambda: self.llm.sleep(level=0, mode="keep"))
        outputs = []
        while compat.pending_outputs(self.llm):
            outputs.extend(self._deltas(self._watched("pause", lambda: compat.engine_step(self.llm))))
        return outputs

    def stream_release(self) -> None:
        self._watched("resume", lambda: self.llm.wake_up(tags=["scheduling"]))

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise Failure("INVALID_ARGUMENT", f"generate: unknown sampling parameters {', '.join(unknown)} (known: "
                          f"{', '.join(SAMPLING_KEYS)})")
        params = self._vllm.SamplingParams(logprobs=0, **sampling)
        requests = [self._prompt(prompt) for prompt in prompts]
        outputs = []
        for result in self._watched("generate", lambda: self.llm.generate(requests, params, use_tqdm=False)):
            completion = result.outputs[0]
            # (cached_tokens: the prompt's tokens vLLM took from its prefix cache.)
            output = {"token_ids": list(completion.token_ids), "logprobs": _sampled_logprobs(completion),
                      "cached_tokens": int(result.num_cached_tokens or 0)}
            if result.prompt_logprobs is not None:
                output["prompt_logprobs"] = [None if step is None else step[token].logprob
                                             for step, token in zip(result.prompt_logprobs, result.prompt_token_ids)]
            outputs.append(output)
        return outputs

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        print(f"wsync vllm runtime: {self.timing_summary()}", file=sys.stderr, flush=True)
        if self._channels is not None:
            self._channels.close()  # (the workers' channel threads end)
        if self._channel_dir is not None:
            shutil.rmtree(self._channel_dir, ignore_errors=True)
        compat.shutdown_engine_core(self.llm)


def _sampled_logprobs(completion: Any) -> list[float]:
    """The log-probability of each token a vLLM CompletionOutput sampled."""
    return [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)]
