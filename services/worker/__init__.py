"""The worker: one process per device, running the shards the scheduler places on it
(``python -m services.worker``; settings ``TESSERA_WORKER_*``, ``settings.py``).

Its rooms, by what they hold (each imports only the rooms above it in this list):

- ``device/``: what every worker shares whatever runs the model: ``DeviceWorker`` (the device
  it stands for, the shard-task consumer, status and token replies, loading and weights
  progress), its metrics, GPU readings, the refusal an engine of token ids sends, and what an
  engine run as a process of its own needs.
- ``torch/``: the torch ring, ``TorchWorker``: layer shards in PyTorch on this host, their
  engine stepping every request as one batch, and the model's pieces it runs.
- ``rpc/``: llama.cpp's RPC: this device's ``ggml-rpc-server``, the mutual-TLS channel that
  reaches it between hosts, its tensor cache, and ``python -m services.worker.rpc.lender``
  (a device lending its CPU alone).
- ``served/``: engines run as server processes: ``ServedWorker`` and its two kinds,
  ``VllmWorker`` (vLLM, whole models) and ``LlamaWorker`` (llama.cpp's ``llama-server``, split
  across devices through their RPC servers).

The shape: template methods, one level deep. ``DeviceWorker`` runs what every worker does and
calls abstract hooks (``open_engine``, ``close_engine``, ``on_task``, ``on_generate``,
``on_cancel``, ``on_hidden``, ``expire``, ``tick``, ``preload``); each engine kind implements
each hook once. ``ServedWorker`` implements the hooks every served engine shares and calls
abstract hooks of its own (``refusal``, ``same_server``, ``hold_weights``, ``on_lent_task``)
that vLLM and llama.cpp each implement; ``EngineServer`` likewise (``command``, ``check``,
``prepare``, ``release``, ``complete``). No method extends its parent's: nothing in the worker
calls ``super()`` but ``__init__`` (``tests/unit/test_architecture.py`` holds both rules).
"""
