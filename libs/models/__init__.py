"""The model files and the PyTorch pieces the CPU shard worker runs (I/O and torch live here)."""
