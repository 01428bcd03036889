"""Tessera's shared code: contracts, the pure scheduling core, runtime helpers and the CLI."""
