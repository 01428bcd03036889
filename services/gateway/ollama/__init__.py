"""Ollama's API (``/api/…``), translated onto the OpenAI path, and its model endpoints."""
