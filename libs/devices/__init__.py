"""Device classes and the devices built from them: emulated ones and this host.

``classes``, ``emulated`` and ``fleetfile`` are pure models (no I/O): the telemetry service runs
emulated fleets from them and the simulator drives the same models. ``host`` reads this host
itself (memory, load, battery and temperature through psutil, its GPU through NVML, power from
RAPL counters), and ``calibration`` times numpy kernels here and caches the result in a file.
None of them imports a network or service library (NATS, Redis, HTTP, Celery, tracing).
"""
