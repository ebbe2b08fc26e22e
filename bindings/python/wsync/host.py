"""wsync.Host: a wsync host in this process (ws_host_* of bindings/wsync.h)."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from . import _native
from .errors import StateError, from_error, from_status


class Host:
    """A wsync host: a LuaJIT state with wsync's modules and a libuv loop, in this process.

    Every trainer rank's agent lives in a host (``Agent`` opens one of its own when given
    none). ``Host(recipe)`` also runs a model recipe's session in this process, for a
    single-process trainer: its ranks are this process's agents (``host.agent(...)``), and
    the session advances while their calls run. A host is not thread-safe: use it from the
    thread that opened it.
    """

    def __init__(self, recipe: Optional[str] = None, **overrides: Any):
        """`overrides` set the recipe's fields and parameters as ``wsync run RECIPE
        KEY=VALUE`` does: a dotted field path (``**{"trainer.steps": 5}``), or the same with
        ``__`` for each dot (``trainer__steps=5``), or a parameter's name."""
        self._lib = _native.library()
        handle = ctypes.c_void_p()
        status = self._lib.ws_host_open(ctypes.byref(handle))
        if status != 0:
            raise from_status(status, _native.text(self._lib.ws_last_error()), "ws_host_open")
        self._handle: Optional[ctypes.c_void_p] = handle
        self._thread = threading.get_ident()
        self._agents: list[Any] = []
        self.endpoint: Optional[str] = None
        self._eval_buffer: Optional[ctypes.Array] = None
        self._finished = recipe is None
        if recipe is not None:
            try:
                self._start(recipe, overrides)
            except BaseException:
                self.close()
                raise

    # -- the host's own calls --------------------------------------------------------------

    def _checked(self, call: str) -> ctypes.c_void_p:
        if self._handle is None:
            raise StateError(f"{call}: the host is closed", "ESTATE", call)
        if threading.get_ident() != self._thread:
            raise StateError(f"{call}: a wsync host is used from the thread that opened it only", "ESTATE", call)
        return self._handle

    def _fail(self, status: int, call: str) -> None:
        if status != 0:
            raise from_status(status, _native.text(self._lib.ws_host_error(self._handle)), call)

    def run_string(self, code: str, chunk_name: str = "=(python)") -> None:
        """Runs a Lua chunk in the host, then its loop until no work is left."""
        handle = self._checked("run_string")
        self._fail(self._lib.ws_host_run_string(handle, code.encode(), chunk_name.encode()), "run_string")

    def eval(self, code: str, result_bytes: int = 1 << 20) -> str:
        """Runs a Lua chunk without running the loop (it must not wait on it) and returns
        what it returned, as a string."""
        handle = self._checked("eval")
        result = self._result_buffer(result_bytes)
        self._fail(self._lib.ws_host_eval(handle, code.encode(), result, result_bytes), "eval")
        return result.value.decode()

    def _result_buffer(self, size: int) -> Any:
        """The buffer eval and call answer into, at least ``size`` bytes. One buffer, kept and
        grown, and mapped rather than allocated: ctypes.create_string_buffer zeroes all of it
        (150 ms for the 256 MiB a loader plan may need, in every TP worker, at its first
        publication), where an anonymous mapping costs only the pages an answer writes."""
        if self._eval_buffer is None or ctypes.sizeof(self._eval_buffer) < size:
            self._eval_buffer = (ctypes.c_char * size).from_buffer(mmap.mmap(-1, size))
        return self._eval_buffer

    def call(self, name: str, result_bytes: int = 1 << 20, **args: Any) -> Any:
        """Calls one of wsync's functions for embedding programs (bindings/wsync.h's
        ws_host_call: "recipe", "trainer_tensors", "reports", "rollout", "loader_plan",
        "worker_command", "device") with ``args`` as JSON, and returns its result decoded.
        A refusal or failure of wsync's own raises WsyncError (InvalidArgument for what the
        caller gave) with its code, message and ``fields``."""
        handle = self._checked("call")
        result = self._result_buffer(result_bytes)
        self._fail(self._lib.ws_host_call(handle, name.encode(), json.dumps(args).encode(), result, result_bytes),
                   f"call {name}")
        answer = json.loads(result.value.decode())
        if not answer.get("ok"):
            raise from_error(answer.get("error") or {}, f"call {name}")
        return answer.get("result")

    def run_file(self, path: str, *args: str) -> None:
        """Runs a Lua file with `args` in `arg`, then the loop."""
        handle = self._checked("run_file")
        argv = (ctypes.c_char_p * max(len(args), 1))(*[str(arg).encode() for arg in args])
        self._fail(self._lib.ws_host_run_file(handle, os.fsencode(path), len(args), argv), "run_file")

    def _start(self, recipe: str, overrides: dict[str, Any]) -> None:
        handle = self._checked("Host(recipe)")
        words = override_words(overrides)
        argv = (ctypes.c_char_p * max(len(words), 1))(*[word.encode() for word in words])
        endpoint = ctypes.create_string_buffer(4096)
        status = self._lib.ws_host_start_recipe(handle, os.fsencode(recipe), len(words), argv, endpoint,
                                                ctypes.sizeof(endpoint))
        self._fail(status, f"Host({recipe!r})")
        self.endpoint = endpoint.value.decode()

    def agent(self, rank: int = 0, world: int = 1, **options: Any) -> Any:
        """An agent of this host's own session (``Host(recipe)``): `Agent(host.endpoint,
        rank, world, host=host, **options)`."""
        from .agent import Agent  # noqa: PLC0415 (agent imports host)
        if self.endpoint is None:
            raise StateError("agent: this host runs no recipe (open it as Host(recipe))", "ESTATE", "agent")
        agent = Agent(self.endpoint, rank, world, host=self, **options)
        self._agents.append(agent)
        return agent

    def generate(self, prompts: list[list[int]], **sampling: Any) -> dict[str, Any]:
        """Generates from token-id prompts in the rollout runtime the session publishes into,
        between publications: ``{model_version, outputs: [{token_ids, logprobs, ...}]}``,
        each output stamped with the model version committed when it was dispatched.
        ``sampling`` is the runtime's sampling parameters (the vllm runtime: ``max_tokens``,
        ``temperature``, ``prompt_logprobs``, ...)."""
        return self._rollout("generate", {"prompts": [list(map(int, prompt)) for prompt in prompts],
                                          "sampling": sampling})

    def submit(self, requests: list[dict[str, Any]]) -> list[int]:
        """Queues streaming requests (``{prompt: [token ids], max_tokens, sampling}``) in the
        rollout runtime; their ids. They generate between publications and, with a
        schedule that pauses in keep mode around ``publish``, across them."""
        payload = [{"prompt": list(map(int, request["prompt"])), **{k: v for k, v in request.items() if k != "prompt"}}
                   for request in requests]
        return list(self._rollout("submit", {"requests": payload})["ids"])

    def poll(self, ids: Optional[list[int]] = None) -> dict[str, Any]:
        """What streaming requests (all, or ``ids``) produced since the last poll:
        ``{requests: [{id, tokens, logprobs, first_token, spans, done, finish, generated,
        model_version}], in_flight}``; a request's version spans (``{version, first_token,
        last_token[, kv]}``) say which model version produced which of its tokens."""
        return self._rollout("poll", {"ids": list(ids)} if ids else {})

    def runtime_info(self) -> dict[str, Any]:
        """What the session's rollout runtime says of itself (``info``)."""
        return self._rollout("info", {})

    def reports(self) -> list[dict[str, Any]]:
        """The session's rounds so far (the newest 32), FAILED ones included, as ``wsync run
        --report`` writes them: ``round``, ``step``, ``outcome`` (``"ok"`` or ``"failed"``) and
        ``error``, ``seconds`` (the round, from the last answer to its own), ``steps`` (in
        order, each ``{name, kind, where, seconds, bytes, device_memory, outcome}``: the waits
        for the ranks ``train_step`` and ``publish_wait``, the schedule's steps, ``publish``,
        ``resident_check``), and the publication's: ``model_version``, ``committed``,
        ``bytes``, ``gbps``, ``timings`` (seconds of each phase: ``preflight``, ``init``,
        ``start``, ``chunks``, ``fill``, ``load``, ``verify``, ``finish``, ``release``,
        ``total``; ``fill_copy`` and ``load_copy`` the copies alone; ``commit`` the runtime's
        own commit within ``finish`` where it says; null for a phase not reached), ``overlaps`` (which phases run at once) and ``receipts`` (the TP workers'
        receipts, as the runtime gave them)."""
        return list(self.call("reports", result_bytes=16 << 20))

    def _rollout(self, cmd: str, payload: dict[str, Any]) -> dict[str, Any]:
        return dict(self.call("rollout", result_bytes=64 << 20, cmd=cmd, payload=payload))

    def finish(self) -> None:
        """Closes this host's agents and waits until the session of ``Host(recipe)`` ends:
        returns when it ended well, raises its failure otherwise."""
        handle = self._checked("finish")
        for agent in self._agents:
            agent.close()
        self._agents.clear()
        if self._finished:
            return
        self._finished = True
        self._fail(self._lib.ws_host_finish_recipe(handle), "finish")

    def close(self) -> None:
        """Closes the host: every handle, the loop and the Lua state. A session of
        ``Host(recipe)`` that did not finish is stopped fail-stop (its runtime killed,
        nothing more published). Agents of this host must be closed before; those left
        open are closed here."""
        if self._handle is None:
            return
        for agent in self._agents:
            agent.close()
        self._agents.clear()
        handle, self._handle = self._handle, None
        self._lib.ws_host_close(handle)

    @property
    def handle(self) -> ctypes.c_void_p:
        """The ws_host pointer (for Agent)."""
        return self._checked("host")

    def __enter__(self) -> "Host":
        return self

    def __exit__(self, kind: Any, value: Any, trace: Any) -> None:
        try:
            if kind is None and self._handle is not None:
                self.finish()
        finally:
            self.close()


@dataclass(frozen=True)
class TrainerTensor:
    """A tensor a recipe's model expects from the trainer (its global shape)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def trainer_tensors(recipe: str, **overrides: Any) -> list[TrainerTensor]:
    """The trainer tensors that model recipe `recipe` expects, in its layout order: what
    each rank registers (its rows of dim 0 of each), e.g. to map a model's parameter names."""
    words = override_words(overrides)
    with Host() as host:
        items = host.call("trainer_tensors", result_bytes=64 << 20, recipe=recipe, overrides=words)
    return [TrainerTensor(item["name"], item["dtype"], tuple(item["shape"])) for item in items]


def override_words(overrides: dict[str, Any]) -> list[str]:
    """The command line's ``KEY=VALUE`` words of a recipe's overrides: ``__`` in a key is a
    dot (``trainer__steps`` is ``trainer.steps``), True and False are Lua's ``true`` and
    ``false``; other values as ``str`` writes them (a table as Lua source, ``"{...}"``)."""
    words = []
    for key, value in overrides.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        words.append(f"{key.replace('__', '.')}={text}")
    return words


_LUA_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ./_-=+:,@")


def lua_literal(text: str) -> str:
    """A Lua string literal of `text` (any text), for a chunk given to ``Host.eval`` or
    ``run_string``. A long bracket (``[==[...]==]``, its level one that does not occur in
    `text`) where Lua reads `text` back unchanged: no carriage return (Lua turns end-of-line
    sequences into newlines), no NUL (the chunk is a C string), no leading newline (Lua skips
    it). Otherwise, or for non-ASCII text, every byte outside a safe set escaped. The package
    itself calls wsync through ``Host.call``, with JSON, not Lua text."""
    if text.isascii() and "\r" not in text and "\0" not in text and not text.startswith("\n"):
        level = 0
        while "]" + "=" * level + "]" in text or text.endswith("]" + "=" * level):
            level += 1
        return "[" + "=" * level + "[" + text + "]" + "=" * level + "]"
    return '"' + "".join(chr(byte) if byte in _LUA_SAFE else f"\\{byte:03d}" for byte in text.encode()) + '"'


def version() -> str:
    """libwsync's version string."""
    return _native.text(_native.library().ws_version())
