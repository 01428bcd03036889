"""Device classes and emulated devices (pure models, no I/O).

The telemetry service runs emulated fleets from these; the simulator drives the same models.
"""
