"""The vllm rollout runtime of wsync, Python side.

The wsync host spawns ``python3 -m wsync.vllm`` (a recipe with ``runtime.kind = "vllm"``); that
process owns ``vllm.LLM`` and answers wsync's control protocol on fd 3, as the reference
runtime does. Its code is split by the process it runs in:

- ``wsync.vllm.runtime``: the runtime's main process (the serving end of the control
  protocol, the state machine and commands, the engine, streaming, the channels' runtime
  end);
- ``wsync.vllm.worker``: what runs inside each of vLLM's TP workers (the worker extension,
  the channel's worker end, receipts, vLLM 0.26's ``update_info`` wire format);
- here, what both share: ``failure`` (the one exception, a WsyncError, and the fault-spec
  parser), ``protocol`` (wsync's framing), ``contract`` (the checks of a header, the
  workers' receipts and a finish answer: the twin of scripts/wsync/runtime/contract.lua,
  tested on the same cases), ``compat`` (everything read of vLLM and torch past vLLM's
  documented ``LLM`` API, one function each, and the check of vLLM's version).

Importing this package imports neither vLLM nor torch; ``runtime.engine``, ``worker.extension``
and ``worker.wire`` do when they are used, vLLM only through ``compat.vllm()``, which refuses a vLLM outside
the supported range (0.26.x) unless ``WSYNC_VLLM_UNSUPPORTED=1``, which makes it a warning.
"""
