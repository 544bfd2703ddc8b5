"""The HTTP APIs on one port (``modeld serve --http 127.0.0.1:PORT``): OpenAI chat completions
and completions, OpenAI's Responses API, Anthropic's Messages API, Ollama's API and the SGLang
gateway's worker routes, so coding agents work unchanged, on warm sessions. Design records:
``blueprints/0014-openai-http.md``, ``blueprints/0019-agent-apis.md``.

The live page and the request records (``ui/``: GETs of the daemon's state, blueprint 0022) sit
beside them. One folder per API (``openai/``, ``responses/``, ``anthropic/``, ``ollama/``, ``sglang/``), each
with the same files: ``<api>/request.py`` (its wire format to the one turn), ``<api>/answer.py``
(the turn's events to its wire format, and its ``Dialect``), ``<api>/routes.py``, and a store
where the API has one. An API imports only the shared layer below, never another API:

* the turn and the conversation layer: ``turn.py`` (what every API parses into),
  ``conversations.py`` (a turn run on its conversation's warm session: its events),
  ``sessions.py`` (the table of those sessions: one per conversation, waited for while the
  engine finishes a turn),
  ``diagnosis.py`` (where a prompt parted from an earlier request's: cache diagnosis);
  ``window.py`` (a turn's prompt checked against the window before anything is computed);
* reading requests and shaping answers alike: ``fields.py`` (typed, bounded field readers),
  ``requests.py`` (samplers from each API's sampler map, ids, text parts, tool calls, response
  formats), ``chat_template.py`` (the template's arguments each API maps, what every API says
  of a model's template), ``answers.py`` (the ``modeld`` extension, logprobs, SSE), ``errors.py`` (one status
  table; OpenAI's error words), ``dialect.py`` (an API's words as a value);
* the service, by job: ``access.py`` (key, Host, Origin, bounded bodies), ``drain.py``,
  ``models.py`` (names to model files) and ``catalog.py`` (what each can do here, the session a
  turn opens), ``runner.py`` (a turn answered in its dialect's words), ``app.py`` (them together,
  ``/health``, ``/metrics``);
* the app: ``routes.py`` (every API's routes: the only module that imports them all) and
  ``listener.py`` (uvicorn on a thread of the daemon).

Starlette and uvicorn (the ``http`` extra) are imported by the service and the app, never by the
engine below.
"""
