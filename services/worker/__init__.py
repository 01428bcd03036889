"""Workers: CPU shard workers, the vLLM worker and Celery batch workers."""
