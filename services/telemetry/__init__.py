"""Telemetry agents, one per device (real host probe or emulated): announce, samples."""
