"""The vllm runtime's main process (``python3 -m wsync.vllm``, which the wsync host spawns):
what runs there and nowhere else.

- ``server``: the serving end of wsync's control protocol on fd 3, and its fault injection;
- ``commands``: the runtime's state machine and commands (versions, headers, receipts,
  generation stamped with the committed version), ``Runtime``;
- ``engine``: the engine behind it, vLLM's ``LLM`` with wsync's worker extension, and the
  watch of vLLM's processes;
- ``streams``: streaming generation (requests in flight across publications);
- ``channels``: the runtime's end of the sockets straight to each TP worker.

What runs inside vLLM's TP workers is wsync.vllm.worker; what both processes share
(``failure``, ``protocol``, ``contract``, ``compat``) is in wsync.vllm itself.
"""
