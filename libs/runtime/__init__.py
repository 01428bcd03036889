"""Runtime helpers for services: settings, logging, connections, lifecycle, embedded servers.

Unlike the contracts and the scheduling core, this package does I/O.
"""
