"""Batch and deadline jobs through Celery (Redis broker): one queue per device."""
