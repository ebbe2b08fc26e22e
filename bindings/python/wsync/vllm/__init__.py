"""The vllm rollout runtime of wsync, Python side.

The wsync host spawns ``python3 -m wsync.vllm`` (a recipe with ``runtime.kind = "vllm"``); that
process owns ``vllm.LLM`` and answers wsync's control protocol on fd 3, as the reference
runtime does. Modules:

- ``protocol``, ``server``: the framing and the serving end of wsync's control protocol;
- ``runtime``: the runtime's state machine and commands (versions, headers, receipts,
  generation stamped with the committed version);
- ``contract``: the runtime contract, the checks of a header, the workers' receipts and a
  finish answer (the twin of scripts/wsync/runtime/contract.lua, tested on the same cases);
- ``receipts``: the receipt a TP worker builds;
- ``engine``: the engine behind it, vLLM's ``LLM`` with wsync's worker extension;
- ``extension``: the worker extension that runs inside each of vLLM's TP workers;
- ``wire``: vLLM 0.26's packed IPC ``update_info``, for the ``native`` load mode;
- ``compat``: everything read of vLLM and torch past vLLM's documented ``LLM`` API, one
  function each, and the check of vLLM's version (the supported range, what an upgrade has
  to check).

Importing this package imports neither vLLM nor torch; ``engine``, ``extension`` and ``wire``
do when they are used, vLLM only through ``compat.vllm()``, which refuses a vLLM outside
the supported range (0.26.x) unless ``WSYNC_VLLM_UNSUPPORTED=1``, which makes it a warning.
"""
