"""The Celery worker that runs the batches ' requests."""
