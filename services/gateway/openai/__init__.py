"""OpenAI's API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/models``): its request and answer shapes, its requests as the core's ``Ask``, and its
routes. The other APIs translate their requests into OpenAI's and come through here."""
