"""Tools for benchmarks and tests only: the fault (chaos) and malformed-message (fuzz) drivers,
worker processes placed by hand, and the exact reference solver. No service imports this."""
