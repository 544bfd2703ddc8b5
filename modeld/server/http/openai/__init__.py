"""OpenAI's chat completions and completions, and ``/v1/models``: the request as a turn
(``request.py``), its answers and the ``OPENAI`` dialect (``answer.py``), the routes
(``routes.py``; each also without ``/v1``)."""
