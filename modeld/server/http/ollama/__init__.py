"""Ollama's API, for the editor integrations that speak it: the request as a turn
(``request.py``), the NDJSON answers and the model entries (``answer.py``), the routes
(``routes.py``)."""
