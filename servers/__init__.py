"""Runnable services: the OpenAI-compatible recording proxy (and later a remote reward server)."""
