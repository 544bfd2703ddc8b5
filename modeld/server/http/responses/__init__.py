"""OpenAI's Responses API, what Codex CLI speaks: the request as a turn (``request.py``), the
response object and its event stream (``answer.py``), the routes (``routes.py``) and the stored
responses ``previous_response_id`` continues (``store.py``)."""
