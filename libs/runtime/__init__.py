"""Plumbing every service uses: settings, logging, tracing, metrics, NATS and Redis adapters,
process and HTTP helpers, lifecycle.

Unlike the contracts and the scheduling core, this package does I/O. It knows nothing of the
local cluster (``libs/cluster``) or of the test harness (``libs/harness``).
"""
