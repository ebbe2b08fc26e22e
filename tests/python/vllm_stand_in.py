"""A stand-in for vLLM behind the vllm runtime (``WSYNC_VLLM_ENGINE=vllm_stand_in:Engine``), for
tests of the runtime's protocol, states, process tree and direct loader without vLLM (on the
host backend, or on cuda with torch for the parameters' device memory).

It is not a rollout engine. Its TP workers are child processes that only sleep (as vLLM's
EngineCore and workers are children of the runtime), so that tests see the whole tree
destroyed. Its devices are the backend's (wsync's UUIDs). Its "parameters" are memory (host
memory, or torch device memory on cuda) laid out as the loader plan's resident tensors, one
allocation each, written by the very loader the vllm runtime's direct mode runs inside vLLM's
workers (wsync.vllm.worker.extension.DirectLoader over scripts/wsync/runtime/engine_worker.lua, on the
shm or the cuda_ipc transport): what a publication leaves there can be checked (verify = "values").
Its "generation" is a toy: each next token is a function of the context and the committed
model version, with log-probability -(token % 7) / 8; it streams too (the ``stream_*``
calls: one token per request in flight per step, a step taking about a millisecond), holds
its requests as vLLM's scheduler does in a keep-mode pause, and counts the held requests
whose KV cache a commit made it recompute. $WSYNC_STAND_IN_FAULT makes one command
fail ("load_chunk:2" fails chunk 2's load; "finish:receipt" returns a receipt with a wrong
manifest; "finish:corrupt" flips a bit of a parameter after its load; "start:crash" kills a
worker process). With $WSYNC_STAND_IN_WORKERS=linger its close leaves the worker processes
running, as vLLM's EngineCore outlives a runtime killed in its close: only the host (a group
kill) or its guard then ends them.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any

from wsync import Host
from wsync.vllm.worker.extension import DirectLoader, LoaderPlan
from wsync.vllm.failure import Failure


class Engine:
    def __init__(self, tp: int, devices: list[int], backend: str, model: str, load: str,
                 engine_args: dict[str, Any], timeouts: dict[str, float]) -> None:
        if backend not in ("host", "cuda"):
            raise Failure("RUNTIME_START", f"the stand-in engine runs on the host or cuda backend, not {backend}")
        self.backend, self.tp, self.devices, self.load = backend, tp, devices, load
        self.transport = "shm" if backend == "host" else "cuda_ipc"
        self.fault = os.environ.get("WSYNC_STAND_IN_FAULT", "")
        self._state = {"weights": "awake", "kv_cache": "reserved"}
        # (The hosts first: a libwsync that cannot be loaded must leave no worker behind.)
        self.hosts = [Host() for _ in range(tp)]
        self.uuids = [self.hosts[0].call("device", backend=backend, index=int(device))["uuid"]
                      for device in devices]
        self.processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
                          for _ in range(tp)]
        self.loaders = [self._loader(rank) for rank in range(tp)]
        self.memories: list[list[Any]] = [[] for _ in range(tp)]
        self.residents: list[dict[str, dict[str, Any]]] = [{} for _ in range(tp)]
        self.version = 0
        self.streaming: dict[int, dict[str, Any]] = {}
        self.holding, self.recomputed = False, 0
        self.commits: list[dict[str, Any]] = []

    def _check_workers(self) -> None:
        for rank, worker in enumerate(self.processes):
            if worker.poll() is not None:
                raise Failure("WORKER_DIED", f"TP worker {rank} (pid {worker.pid}) exited ({worker.returncode})",
                              fatal=True, rank=rank)

    def workers(self) -> list[dict[str, Any]]:
        return [{"rank": rank, "pid": worker.pid, "device": {"backend": self.backend, "index": self.devices[rank],
                                                              "uuid": self.uuids[rank]}}
                for rank, worker in enumerate(self.processes)]

    def state(self) -> dict[str, str]:
        return dict(self._state)

    def sleep(self, level: int) -> None:
        self._check_workers()
        self._state = {"weights": "offloaded" if level == 1 and self._state["weights"] == "awake" else "discarded",
                       "kv_cache": "free"}

    def wake(self, tags: list[str]) -> None:
        self._check_workers()
        if "weights" in tags:
            self._state["weights"] = "awake"
        if "kv_cache" in tags:
            self._state["kv_cache"] = "reserved"

    def _loader(self, rank: int) -> DirectLoader:
        identity = {"rank": rank, "world": self.tp, "device": {"backend": self.backend, "index": self.devices[rank],
                                                                "uuid": self.uuids[rank]}}
        # (The fingerprint: where each parameter lies; unchanged publications say so.)
        return DirectLoader(identity, self.hosts[rank], lambda: self.residents[rank],
                            lambda: tuple(sorted((name, r["pointer"]) for name, r in self.residents[rank].items())))

    def _allocate(self, rank: int, nbytes: int) -> Any:
        """One parameter's memory: host memory, or device memory from torch on cuda."""
        if self.backend == "host":
            return ctypes.create_string_buffer(nbytes)
        import torch
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{self.devices[rank]}")

    def _address(self, memory: Any) -> int:
        return ctypes.addressof(memory) if self.backend == "host" else memory.data_ptr()

    def init_weights(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self._check_workers()
        results = []
        for rank in range(self.tp):
            plan = LoaderPlan(self.hosts[rank], payload["family"], payload["config"], self.tp, rank)
            memories = [self._allocate(rank, resident["bytes"]) for resident in plan.residents]
            self.memories[rank] = memories
            self.residents[rank] = {
                resident["name"]: {"pointer": self._address(memory), "size": resident["bytes"],
                                   "dtype": resident["dtype"], "shape": resident["shape"]}
                for resident, memory in zip(plan.residents, memories)}
            results.append(self.loaders[rank].init_weights(payload))
        return results

    def start_update(self, header: dict[str, Any]) -> None:
        self._check_workers()
        if self.fault == "start:crash":
            os.kill(self.processes[0].pid, signal.SIGKILL)
            self.processes[0].wait()
            self._check_workers()
        for loader in self.loaders:
            loader.start_update({"header": header})

    def load_chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self._check_workers()
        chunk = payload["chunk"]
        if self.fault == f"load_chunk:{chunk}":
            raise Failure("LOAD_FAILED", f"TP worker 0, chunk {chunk}: injected failure", fatal=True, rank=0)
        return [loader.load_chunk(payload) for loader in self.loaders]

    def finish_update(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        self._check_workers()
        payload = {"publication_id": header["publication_id"], "model_version": header["model_version"]}
        receipts = [loader.finish_update(payload) for loader in self.loaders]
        if self.fault == "finish:receipt":
            receipts[0]["manifest"] = "0" * 64
        if self.fault == "finish:corrupt":  # one byte of the last TP rank's second parameter, after its load
            memory = self.memories[-1][1]
            if self.backend == "host":
                memory[0] = bytes([memory.raw[0] ^ 0x40])
            else:
                memory[0] ^= 0x40
        return receipts

    def resident_values(self) -> list[dict[str, Any]]:
        self._check_workers()
        return [loader.resident_values({}) for loader in self.loaders]

    def commit(self, model_version: int, preempt: bool = False, in_flight: bool = False) -> str:
        # (As vLLM's engine: later requests hash apart under the new version; requests still
        # in the engine need the reset, held ones preempted.)
        self.version = model_version
        self.commits.append({"model_version": model_version, "preempt": preempt, "in_flight": in_flight})
        if preempt:
            self.recomputed += len(self.streaming)
        return "reset" if preempt or in_flight else "salted"

    # Streaming (wsync.vllm.runtime.streams) ---------------------------------------------------

    def _next(self, context: list[int]) -> int:
        return (sum(context[-8:]) * 31 + self.version * 7 + len(context)) % 1000

    def stream_add(self, request_id: int, prompt: list[int], sampling: dict[str, Any]) -> None:
        self._check_workers()
        if len(prompt) + int(sampling["max_tokens"]) > 65536:  # (as vLLM refuses more than max_model_len)
            raise Failure("INVALID_ARGUMENT", f"the prompt's {len(prompt)} tokens and max_tokens "
                          f"{sampling['max_tokens']} exceed the model's 65536")
        self.streaming[request_id] = {"context": list(prompt), "left": int(sampling["max_tokens"])}

    def stream_step(self) -> list[dict[str, Any]]:
        self._check_workers()
        if self.holding:
            raise Failure("WORKER_FAILED", "stream_step while the requests are held", fatal=True)
        time.sleep(0.001)
        outputs = []
        for request_id, request in list(self.streaming.items()):
            token = self._next(request["context"])
            request["context"].append(token)
            request["left"] -= 1
            finished = request["left"] == 0
            outputs.append({"id": request_id, "token_ids": [token], "logprobs": [-(token % 7) / 8],
                            "finished": finished, "finish": "length" if finished else None})
            if finished:
                del self.streaming[request_id]
        return outputs

    def stream_abort(self, ids: list[int]) -> None:
        for request_id in ids:
            self.streaming.pop(request_id, None)

    def stream_hold(self) -> list[dict[str, Any]]:
        self.holding = True
        return []

    def stream_release(self) -> None:
        self.holding = False

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        self._check_workers()
        count = int(sampling.get("max_tokens", 4))
        outputs = []
        for prompt in prompts:
            context, tokens = list(prompt), []
            for _ in range(count):
                token = (sum(context) * 31 + self.version * 7 + len(context)) % 1000
                tokens.append(token)
                context.append(token)
            outputs.append({"token_ids": tokens, "logprobs": [-(token % 7) / 8 for token in tokens]})
        return outputs

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()
        for host in self.hosts:
            host.close()
        self.loaders, self.hosts = [], []
        if os.environ.get("WSYNC_STAND_IN_WORKERS") == "linger":
            return  # (as vLLM's EngineCore outlives a runtime whose close was cut short)
        for worker in self.processes:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
