"""Streaming generation in the vllm runtime: requests submitted, several in flight, polled
for what they produced, paused and resumed in vLLM's modes across publications.

The runtime (wsync.vllm.runtime) keeps this between its commands; the engine generates:
its ``stream_*`` calls (wsync.vllm.runtime.engine, with vLLM's own scheduler) add requests, take
what one engine step produced, abort, hold every request (vLLM's scheduler paused in its
"keep" mode) and release them. Each token is stamped with the model version committed when
it was produced, and a request's version spans (``{version, first_token, last_token}``,
token indices from 0) say which version produced which part, as the reference runtime's
toy decoder does (scripts/wsync/runtime/decoder.lua): the host reads both the same way.

Pause modes (vLLM's): ``abort`` ends the requests in flight (finish "aborted"), ``wait``
lets them finish first, ``keep`` holds them until resume. The KV cache of held requests
is recomputed under the new weights when a version was committed meanwhile (``kv =
"recompute"``); vLLM 0.26 cannot also drop its prefix cache while held requests keep
their KV, so ``kv = "keep"`` is refused.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..failure import Failure

#: The most tokens one request may ask for (the reference runtime's limit too).
MAX_TOKENS = 65536

PAUSE_MODES = ("abort", "wait", "keep")

#: Sampling parameters a streaming request does not take: its own max_tokens, and what
#: makes more than one sequence or scores the prompt (generate serves those).
UNSTREAMED = ("max_tokens", "n", "prompt_logprobs")


class Streams:
    """The runtime's streaming requests. ``engine`` has the ``stream_*`` calls; ``version``
    gives the model version committed now."""

    def __init__(self, engine: Any, version: Callable[[], int]) -> None:
        self.engine, self.version = engine, version
        self.requests: dict[int, dict[str, Any]] = {}
        self.active: list[int] = []
        self.next_id = 1
        self.paused: Optional[dict[str, Any]] = None

    # Requests -------------------------------------------------------------------------

    def submit(self, requests: Any, sampling_keys: tuple[str, ...]) -> list[int]:
        """Queues requests ``{prompt, max_tokens, sampling}``; their ids. Each is stamped with
        the version committed now (its dispatch). While paused they wait for resume."""
        if requests == {}:  # (an empty Lua table arrives as an object)
            requests = []
        if not isinstance(requests, list):
            raise Failure("INVALID_ARGUMENT", "submit needs a list of requests {prompt, max_tokens}")
        for index, request in enumerate(requests, start=1):
            if not isinstance(request, dict):
                raise Failure("INVALID_ARGUMENT", f"request {index} is not {{prompt, max_tokens}}")
            prompt = request.get("prompt")
            if not isinstance(prompt, list) or not prompt or not all(
                    isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in prompt):
                raise Failure("INVALID_ARGUMENT", f"prompt {index} is not a non-empty list of token ids")
            max_tokens = request.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
                raise Failure("INVALID_ARGUMENT", f"request {index}: max_tokens must be an integer from 1 to "
                              f"{MAX_TOKENS}, got {max_tokens!r}")
            sampling = request.get("sampling") or {}
            if not isinstance(sampling, dict):
                raise Failure("INVALID_ARGUMENT", f"request {index}: sampling must be an object of sampling parameters")
            known = [key for key in sampling_keys if key not in UNSTREAMED]
            unknown = sorted(set(sampling) - set(known))
            if unknown:
                raise Failure("INVALID_ARGUMENT", f"request {index}: sampling parameters {', '.join(unknown)} are "
                              f"not taken by a streaming request (it takes: {', '.join(known)}; max_tokens is its "
                              "own; generate takes n and prompt_logprobs)")
        ids: list[int] = []
        for index, request in enumerate(requests, start=1):
            rid = self.next_id
            self.next_id += 1
            max_tokens = request.get("max_tokens", 16)
            sampling = dict(request.get("sampling") or {}, max_tokens=max_tokens)
            try:
                self.engine.stream_add(rid, list(request["prompt"]), sampling)
            except Failure as refused:
                # (All or none: the requests of this call the engine took are withdrawn.)
                if ids:
                    self.engine.stream_abort(ids)
                for taken in ids:
                    del self.requests[taken]
                self.active = [other for other in self.active if other not in ids]
                raise Failure(refused.code, f"request {index}: {refused.message}", fatal=refused.fatal) from None
            self.requests[rid] = {"id": rid, "tokens": [], "logprobs": [], "spans": [], "polled": 0, "done": False,
                                  "finish": None, "model_version": self.version(), "resumed_kv": None}
            self.active.append(rid)
            ids.append(rid)
        return ids

    def record(self, outputs: list[dict[str, Any]], version: int) -> None:
        """Adds what the engine produced (``{id, token_ids, logprobs, finished, finish}``, the new
        tokens only), stamped ``version``."""
        for output in outputs:
            request = self.requests.get(output["id"])
            if request is None or request["done"]:
                continue
            for token, logprob in zip(output["token_ids"], output["logprobs"]):
                request["tokens"].append(token)
                request["logprobs"].append(logprob)
                n = len(request["tokens"]) - 1
                spans = request["spans"]
                if spans and spans[-1]["version"] == version:
                    spans[-1]["last_token"] = n
                else:
                    span = {"version": version, "first_token": n, "last_token": n}
                    if spans and request["resumed_kv"]:
                        span["kv"] = request["resumed_kv"]
                    request["resumed_kv"] = None
                    spans.append(span)
            if output.get("finished"):
                request["done"], request["finish"] = True, output.get("finish") or "stop"
        self.active = [rid for rid in self.active if not self.requests[rid]["done"]]

    def step(self) -> bool:
        """One engine step for the requests in flight (only while generation may run);
        whether some are still in flight."""
        if self.active and self.paused is None:
            self.record(self.engine.stream_step(), self.version())
        return bool(self.active) and self.paused is None

    def poll(self, ids: Any) -> list[dict[str, Any]]:
        """What each request (all, or those of ``ids``) produced since the last poll, with its
        version spans so far. A finished request is forgotten once polled."""
        if ids in (None, {}, []):
            chosen = sorted(self.requests)
        else:
            if not isinstance(ids, list):
                raise Failure("INVALID_ARGUMENT", "poll: ids must be a list of request ids")
            for rid in ids:
                if rid not in self.requests:
                    raise Failure("INVALID_ARGUMENT", f"no request {rid} (finished ones are forgotten once polled)")
            chosen = list(ids)
        out = []
        for rid in chosen:
            request = self.requests[rid]
            start = request["polled"]
            out.append({"id": rid, "tokens": request["tokens"][start:], "logprobs": request["logprobs"][start:],
                        "first_token": start, "spans": [dict(span) for span in request["spans"]],
                        "done": request["done"], "finish": request["finish"], "generated": len(request["tokens"]),
                        "model_version": request["model_version"]})
            request["polled"] = len(request["tokens"])
            if request["done"]:
                del self.requests[rid]
        return out

    def in_flight(self) -> int:
        return len(self.active)

    def abort_all(self, finish: str = "aborted") -> int:
        """Ends every request in flight (a sleep takes their KV cache); how many."""
        aborted = list(self.active)
        if aborted:
            self.engine.stream_abort(aborted)
        for rid in aborted:
            self.requests[rid]["done"], self.requests[rid]["finish"] = True, finish
        self.active = []
        return len(aborted)

    # Pause ----------------------------------------------------------------------------

    def pause(self, mode: Any, kv: Any) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise Failure("INVALID_ARGUMENT", f"pause mode must be abort, wait or keep, got {mode}")
        if kv not in (None, "recompute", "keep"):
            raise Failure("INVALID_ARGUMENT", f"the KV policy of keep must be recompute or keep, got {kv}")
        if kv == "keep":
            raise Failure("NOT_SUPPORTED", "kv = \"keep\": vLLM 0.26 cannot drop its prefix cache while held "
                          "requests keep their KV cache, so new requests would reuse KV computed under the old "
                          "weights; the vllm runtime recomputes held requests' KV (kv = \"recompute\")")
        if self.paused is not None:
            raise Failure("STATE_REFUSED", f"generation is paused already ({self.paused['mode']})")
        aborted, finished = 0, 0
        if mode == "abort":
            aborted = self.abort_all()
        elif mode == "wait":
            finished = len(self.active)
            while self.active:
                self.record(self.engine.stream_step(), self.version())
        # Every request left is held: what the engine produced before the hold took effect
        # is the committed version's.
        self.record(self.engine.stream_hold(), self.version())
        self.paused = {"mode": mode, "kv": "recompute", "version": self.version()}
        return {"mode": mode, "aborted": aborted, "finished": finished, "held": len(self.active)}

    def held_across(self) -> bool:
        """Whether held requests will go on under weights they were not computed with
        (their KV cache is to be recomputed at the commit)."""
        return self.paused is not None and bool(self.active)

    def resume(self) -> dict[str, Any]:
        paused = self.paused
        if paused is None:
            raise Failure("STATE_REFUSED", "resume without a pause")
        changed = self.version() != paused["version"]
        if changed:
            for rid in self.active:
                self.requests[rid]["resumed_kv"] = "recomputed"
        self.engine.stream_release()
        self.paused = None
        return {"held": len(self.active), "kv": "recomputed" if self.active and changed else None}
