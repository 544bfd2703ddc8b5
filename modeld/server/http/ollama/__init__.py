"""Ollama's API, for the editor integrations that speak it."""
