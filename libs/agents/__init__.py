"""Device agents: publish a device's announce and telemetry (each sample is its heartbeat) over
NATS and follow the work and DVFS hints sent to it — many emulated devices (``fleet``) or this
host (``host``). The telemetry service runs them; each worker runs one for its own device."""
