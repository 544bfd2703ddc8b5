"""Anthropic's Messages API, what Claude Code speaks: the request as a turn (``request.py``), the
message and its event stream (``answer.py``), the routes (``routes.py``)."""
