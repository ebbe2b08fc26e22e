"""On the GPU machine, with vLLM: generation keeps going across publications (keep mode).

The small Qwen3-MoE of tests/gpu/vllm_e2e.py (FSDP2, one rank) publishes three optimizer
steps into vLLM TP1 while four streaming requests generate (Host.submit / Host.poll). The
recipe (tests/fixtures/recipes/vllm_tiny_cuda_keep.lua) pauses vLLM in keep mode around
each publication (vLLM's scheduler holds the requests; sleep level 0, mode "keep") and
resumes it after; the held requests' KV cache is recomputed under the new weights. Checked:
every request produced tokens under every version, each version span says its KV cache was
recomputed after the first, the spans cover the tokens in order, and every token generated
was polled once.

    python3 tests/gpu/vllm_keep.py
Prints one line per request and "vllm_keep: ok"; exits non-zero on any failure.
"""
from __future__ import annotations

import sys
import time

from vllm_trainer import Trainer, verdict

import wsync

RECIPE = "tests/fixtures/recipes/vllm_tiny_cuda_keep.lua"
STEPS, REQUESTS, MAX_TOKENS = 3, 4, 400


def main() -> int:
    trainer = Trainer()
    config = trainer.config
    failures = []
    with wsync.Host(RECIPE) as host:
        agent = trainer.agent(host)
        prompts = [[(7 * i + j) % config.vocab_size for j in range(8)] for i in range(REQUESTS)]
        ids = host.submit([{"prompt": prompt, "max_tokens": MAX_TOKENS, "sampling": {"ignore_eos": True}}
                           for prompt in prompts])
        seen = {rid: {"tokens": 0, "spans": [], "done": False, "generated": 0} for rid in ids}

        def poll() -> None:
            for request in host.poll()["requests"]:
                got = seen[request["id"]]
                if request["first_token"] != got["tokens"]:
                    failures.append(f"request {request['id']}: a poll starts at {request['first_token']}, "
                                    f"{got['tokens']} seen")
                got["tokens"] += len(request["tokens"])
                got.update(spans=request["spans"], done=request["done"], generated=request["generated"],
                           finish=request["finish"])

        for step in range(1, STEPS + 1):
            time.sleep(0.05)  # (vLLM generates meanwhile: 400 tokens take it a few seconds)
            poll()
            trainer.step()
            publication = agent.publish(step)
            print(f"vllm_keep: published version {publication.model_version}", flush=True)
        deadline = time.monotonic() + 120
        while not all(got["done"] for got in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            poll()
    trainer.close()
    for rid, got in seen.items():
        versions = [span["version"] for span in got["spans"]]
        kv = [span.get("kv") for span in got["spans"]]
        contiguous = all(b["first_token"] == a["last_token"] + 1 for a, b in zip(got["spans"], got["spans"][1:]))
        print(f"vllm_keep: request {rid}: {got['tokens']} tokens polled of {got['generated']}, finish "
              f"{got.get('finish')}, versions {versions}, kv {kv}", flush=True)
        if not got["done"] or got["tokens"] != got["generated"] or got["generated"] != MAX_TOKENS:
            failures.append(f"request {rid}: {got['tokens']} tokens polled, {got['generated']} generated, done "
                            f"{got['done']} (want all {MAX_TOKENS})")
        if versions != list(range(STEPS + 1)):
            failures.append(f"request {rid}: tokens from versions {versions}, not 0..{STEPS} (did it generate "
                            "across every publication?)")
        if kv[1:] != ["recomputed"] * (len(kv) - 1) or not contiguous:
            failures.append(f"request {rid}: spans {got['spans']}")
    return verdict("vllm_keep", failures, f"{REQUESTS} requests generated across {STEPS} publications in keep mode")


if __name__ == "__main__":
    sys.exit(main())
