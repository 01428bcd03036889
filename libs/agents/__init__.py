"""Device agents: publish a device's announce and telemetry (each sample is its heartbeat) over
NATS and follow the work and DVFS hints sent to it — many emulated devices (``emulated_fleet``)
or this host (``host_agent``). The telemetry service runs them; each worker runs one for its own
device."""
