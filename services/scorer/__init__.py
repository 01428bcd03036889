"""The scorer: five-dimension capability scores from telemetry, kept in Redis."""
