"""llama.cpp's RPC: this device's ``ggml-rpc-server`` (``server.py``), the mutual-TLS channel
between hosts that reaches it (``channel.py``), the tensor cache it keeps (``cache.py``), and a
device that lends its CPU alone (``lender.py``)."""
