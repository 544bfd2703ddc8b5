"""The OpenAI-compatible HTTP endpoint (``modeld serve --http 127.0.0.1:PORT``).

Coding tools that speak the OpenAI API (aider, Continue, Cline, anything on the ``openai`` SDK
or LiteLLM) use modeld unchanged: each request's messages are rendered with the model's chat
template and mapped onto a warm session, so a tool that resends its whole conversation every
turn pays only for what changed, and every response reports the reused tokens as
``usage.prompt_tokens_details.cached_tokens``. Design record: ``blueprints/0014-openai-http.md``.

Modules: ``models`` (registered model names), ``openai`` (request parsing and response
shapes, no web framework; constrained output and tool calls too),
``conversations`` (affinity: one warm session per conversation), ``turns`` (one request run
on a session), ``app`` (the Starlette routes, auth), ``listener`` (uvicorn in the daemon).
Only ``app`` and ``listener`` import Starlette/uvicorn (the ``http`` extra).
"""
