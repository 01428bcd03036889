"""The discrete-event simulator: the same policy objects as the live scheduler, emulated
devices with the same power, heat and battery models as the telemetry agents. Pure: it reads
workloads from lines of text and takes ``rng`` and time as inputs."""
