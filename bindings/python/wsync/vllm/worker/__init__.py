"""What wsync runs inside each of vLLM's TP workers (vLLM's processes, not wsync's): vLLM
imports it through ``LLM(worker_extension_cls="wsync.vllm.worker.extension.WorkerExtension")``.

- ``extension``: the worker extension, its weight commands (the direct loader, through an
  embedded wsync host, or vLLM's own loader fed with ``wire``'s ``update_info``);
- ``channel``: the worker's end of the runtime's socket channel;
- ``receipts``: the receipt a worker returns at finish_update;
- ``wire``: vLLM 0.26's packed IPC ``update_info``, for the ``native`` load mode.

The runtime's main process is wsync.vllm.runtime; what both share is in wsync.vllm itself.
"""
