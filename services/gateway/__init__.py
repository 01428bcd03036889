"""The gateway: the cluster's HTTP front door (OpenAI-compatible API, admin API, health)."""
