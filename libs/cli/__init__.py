"""The ``tessera`` command for operators."""
