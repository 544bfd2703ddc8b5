"""OpenAI's chat completions and completions (and ``/v1/models``)."""
