"""Tessera's services; each runs as ``python -m services.<name>``."""
