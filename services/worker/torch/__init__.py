"""The torch ring: ``TorchWorker`` (``worker.py``) runs layer shards of a Llama-family model in
PyTorch on this host, with what it holds loaded (``held.py``), what waits for its compute loop
(``inbox.py``), one shard's requests stepped as one batch (``shard_engine.py``, ``actions.py``),
and the model's pieces: a shard (``shard.py``, ``kernels.py``, ``gguf_shard.py``) and sampling
with streaming detokenisation (``decoding.py``)."""
