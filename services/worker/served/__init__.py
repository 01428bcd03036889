"""Engines run as server processes and spoken to over HTTP: the worker they share
(``worker.py``, requests streamed by ``streams.py``), the process itself (``server.py``), vLLM
(``vllm_worker.py``, ``vllm_server.py``) and llama.cpp's ``llama-server`` (``llama_worker.py``,
``llama_server.py``, with ``llama_prompts.py`` and ``chat_templates.py`` for OpenAI's fields)."""
