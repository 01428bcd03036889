"""Anthropic's Messages API (``/v1/messages``), translated onto the OpenAI path."""
