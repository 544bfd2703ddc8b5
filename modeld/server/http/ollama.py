"""Ollama's API on the same port, for editor integrations that speak it (Continue's and Zed's
Ollama providers, Open WebUI, JetBrains): ``GET /api/version``, ``GET /api/tags``, ``POST
/api/show``, ``GET /api/ps``, ``POST /api/chat``, ``POST /api/generate``.

A thin adapter over the conversation layer; answers stream as NDJSON by default (``stream``
true), one JSON object per line, the last with ``done: true``, ``done_reason`` and the counts
and durations (nanoseconds) Ollama reports. Field by field (``blueprints/0019-agent-apis.md``):

* ``model``: a name ``GET /api/tags`` lists; ``NAME:latest`` is the same model (Ollama's tag).
* ``messages`` (roles system, user, assistant, tool; an assistant's ``tool_calls`` with object
  arguments; ``thinking`` accepted in history; ``images`` refused by name), ``tools`` (OpenAI
  function definitions, as Ollama takes them), ``format`` (``"json"`` or a JSON schema: a
  constraint), ``think`` (a reasoning model's thinking is returned as ``message.thinking``;
  false drops it), ``options`` (``num_ctx``, ``num_predict``, ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``,
  ``frequency_penalty``; others refused by name), ``keep_alive`` (a duration: the
  conversation's warm context moves out of the KV, to the RAM tier, after that long idle; the
  model stays loaded under the memory budget).
* ``/api/generate``: ``prompt`` (with ``system``) is one user turn rendered with the model's
  template; ``raw: true`` evaluates it as given. An empty prompt only loads the model.
  ``context`` (the deprecated token array) and ``template`` are refused by name.
* ``/api/ps`` lists the loaded models with their warm contexts (``modeld.contexts``), and
  ``/api/show`` the model's window: ``model_info["<arch>.context_length"]`` as loaded here,
  and ``parameters`` with ``num_ctx``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.contract import DecodeConfig, ModelInfo, ToolCall
from modeld.decoding.toolcalls import new_call_id
from modeld.errors import echo
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.chat_template import template_args, template_meta
from modeld.server.http.conversations import Collected, Delta, Event, Finished, Started
from modeld.server.http.errors import HttpError, bad, unsupported
from modeld.server.http.fields import (
    boolean,
    integer,
    number,
    obj,
    refuse_unknown,
    stop_list,
)
from modeld.server.http.models import ModelEntry
from modeld.server.http.openai_chat import response_format
from modeld.server.http.turn import Keys, Message, Turn, key_value
from modeld.settings import Limits

__all__ = ["OLLAMA_API_VERSION", "ollama_error", "routes"]

OLLAMA_API_VERSION = "0.12.0"
"""The version of Ollama's API this endpoint follows (what ``/api/version`` says): clients
check it before using features such as tools and thinking."""

_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_predict",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        # accepted, no effect here: how Ollama's runner schedules, not what it computes
        "num_thread",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "num_keep",
    }
)
_CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"})
_GENERATE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "system",
        "raw",
        "format",
        "options",
        "stream",
        "keep_alive",
        "think",
        "suffix",
        "images",
        "context",
        "template",
    }
)
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def ollama_error(error: HttpError) -> dict[str, Any]:
    """Ollama's error body: ``{"error": "message"}``."""
    return {"error": error.message}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required")
    if len(model) > 256:
        raise HttpError(404, f"model {echo(model)} not found", code="model_not_found")
    return model.removesuffix(":latest")


def keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive`` (seconds, or a duration such as ``5m``) in seconds; None: unset.
    A negative value means "keep it" (0 to modeld: no idle limit)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("keep_alive", "keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.strip())):
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        raise bad(
            "keep_alive",
            f"keep_alive must be a number of seconds or a duration such as '5m', got {echo(value)}",
        )
    return 0.0 if seconds < 0 else min(seconds, 365 * 24 * 3600.0)


def _decode(body: Mapping[str, Any], tools: bool, limits: Limits) -> tuple[DecodeConfig, int | None, int]:
    """(the decode config, num_predict, num_ctx) from ``options`` and ``format``."""
    options = obj(body, "options") or {}
    refuse_unknown(options, _OPTIONS, "options")
    values: dict[str, Any] = {}
    for name, lo, hi in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("repeat_penalty", 0.0, 10.0),
    ):
        value = number(options, name, lo, hi, param=f"options.{name}")
        if value is not None and not (name == "top_p" and value == 0):
            values[name] = value
    for name in ("presence_penalty", "frequency_penalty"):
        value = number(options, name, -2, 2, param=f"options.{name}")
        if value is not None:
            values[name] = value
    top_k = integer(options, "top_k", 0, 1 << 30, param="options.top_k")
    if top_k is not None:
        values["top_k"] = top_k
    seed = integer(options, "seed", -1, (1 << 64) - 1, param="options.seed")
    if seed is not None and seed >= 0:
        values["seed"] = seed
    predict = integer(options, "num_predict", -2, 1 << 30, param="options.num_predict")
    num_ctx = integer(options, "num_ctx", 1, 1 << 24, param="options.num_ctx") or 0
    fmt = body.get("format")
    if fmt in (None, ""):
        constraint = None
    elif fmt == "json":
        constraint = response_format({"type": "json_object"}, "format")
    elif isinstance(fmt, dict):
        constraint = response_format({"type": "json_object", "schema": fmt}, "format")
    else:
        raise bad("format", f'format must be "json" or a JSON schema object, got {echo(fmt)}')
    if constraint is not None and tools:
        values["tool_choice"] = "none"  # a schema answers; tools would compete with it
    config = DecodeConfig(
        stop=stop_list(options, limits, "stop", param="options.stop"), constraint=constraint, **values
    )
    return config, (None if predict is None or predict < 0 else predict), num_ctx


def _images(message: Mapping[str, Any], where: str) -> None:
    if message.get("images"):
        raise unsupported(f"{where}.images", f"{where}.images: the models modeld serves read text only")


def _messages(body: Mapping[str, Any], limits: Limits) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages", "messages must be an array")
    limits.check("max_messages", len(messages), "messages")
    out: list[Message] = []
    pending: list[str] = []  # the last assistant's call ids its results have not named yet
    numbered = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        refuse_unknown(
            message,
            frozenset(
                {"role", "content", "images", "tool_calls", "thinking", "tool_name", "name", "tool_call_id"}
            ),
            where,
        )
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"{where}.role", f"{where}.role must be system, user, assistant or tool, got {echo(role)}"
            )
        _images(message, where)
        content = message.get("content") or ""
        thinking = message.get("thinking") or ""
        if not isinstance(content, str) or not isinstance(thinking, str):
            raise bad(f"{where}.content", f"{where}.content must be a string")
        calls: list[ToolCall] = []
        for j, call in enumerate(message.get("tool_calls") or []):
            at = f"{where}.tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments", {}) if isinstance(function, dict) else None
            if (
                role != "assistant"
                or not isinstance(name, str)
                or not name
                or len(name) > 256
                or not isinstance(arguments, dict)
            ):
                raise bad(
                    at,
                    f'{at} must be {{"function": {{"name": ..., "arguments": {{...}}}}}} on an assistant message',
                )
            call_id = call.get("id") if isinstance(call.get("id"), str) else ""
            numbered += 1
            # Ollama's calls carry no id: number them in order (9 characters: templates such as
            # Mistral's want that), so their results can name them and every turn renders alike.
            calls.append(
                ToolCall(
                    call_id[:256] or f"call{numbered:05d}", name, json.dumps(arguments, ensure_ascii=False)
                )
            )
        ids = {k: message.get(k) for k in ("tool_call_id", "tool_name", "name")}
        for key, value in ids.items():
            if value is not None and (not isinstance(value, str) or len(value) > 256):
                raise bad(f"{where}.{key}", f"{where}.{key} must be a string of at most 256 characters")
        if calls:
            pending = [c.id for c in calls]
        answered = ""
        if role == "tool":  # a result answers the call it names, else the next one in order
            answered = ids["tool_call_id"] or (pending[0] if pending else "")
            if answered in pending:
                pending.remove(answered)
        out.append(
            Message(
                role,
                content,
                tuple(calls),
                thinking,
                tool_call_id=answered,
                name=ids["tool_name"] or ids["name"] or "",
            )
        )
    return out


def _tools(body: Mapping[str, Any], limits: Limits) -> str:
    tools = body.get("tools")
    if tools is None or tools == []:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "tools must be an array of tool objects")
    limits.check("max_tools", len(tools), "tools")
    return json.dumps(tools, ensure_ascii=False)


def _think_args(body: Mapping[str, Any]) -> tuple[tuple[str, object], ...]:
    """``think`` as the template's: a boolean is ``enable_thinking``, a level (gpt-oss) is
    ``reasoning_effort``; absent leaves the template's default (checked by :func:`_think`)."""
    think = body.get("think")
    if isinstance(think, bool):
        return template_args(enable_thinking=think)
    if think in ("low", "medium", "high"):
        return template_args(reasoning_effort=think, effort_field="think")
    return ()


def _think(body: Mapping[str, Any]) -> bool:
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return think is not False
    if think in ("low", "medium", "high"):
        return True
    raise bad("think", f'think must be a boolean or "low", "medium", "high", got {echo(think)}')


def parse_chat(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits
) -> tuple[Turn, bool, float | None]:
    """An ``/api/chat`` body as a Turn, whether to show thinking, and keep_alive."""
    refuse_unknown(body, _CHAT_FIELDS)
    model = _model(body)
    tools_json = _tools(body, limits)
    decode, predict, num_ctx = _decode(body, bool(tools_json), limits)
    messages = _messages(body, limits)
    stream = boolean(body, "stream")
    turn = Turn(
        api="ollama.chat",
        model=model,
        decode=decode,
        keys=Keys(
            header=key_value("X-Modeld-Conversation", headers.get("x-modeld-conversation")),
            routing=key_value("X-SMG-Routing-Key", headers.get("x-smg-routing-key")),
        ),
        stream=stream is not False,
        messages=tuple(messages),
        tools_json=tools_json,
        max_tokens=predict,
        num_ctx=num_ctx,
        template_args=_think_args(body),
    )
    return turn, _think(body), keep_alive(body.get("keep_alive"))


def parse_generate(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits
) -> tuple[Turn, bool, float | None]:
    """An ``/api/generate`` body as a Turn (``raw``: the prompt as given)."""
    refuse_unknown(body, _GENERATE_FIELDS)
    for name in ("context", "template", "suffix"):
        if body.get(name):
            raise unsupported(
                name,
                f"{name} is not supported by modeld (send the whole prompt; raw: true evaluates it as given)",
            )
    _images(body, "request")
    model = _model(body)
    decode, predict, num_ctx = _decode(body, False, limits)
    prompt = body.get("prompt") or ""
    system = body.get("system") or ""
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise bad("prompt", "prompt and system must be strings")
    raw = boolean(body, "raw") or False
    keys = Keys(
        header=key_value("X-Modeld-Conversation", headers.get("x-modeld-conversation")),
        routing=key_value("X-SMG-Routing-Key", headers.get("x-smg-routing-key")),
    )
    common: dict[str, Any] = {
        "model": model,
        "decode": decode,
        "keys": keys,
        "stream": boolean(body, "stream") is not False,
        "max_tokens": predict,
        "num_ctx": num_ctx,
    }
    if raw:
        turn = Turn(api="ollama.generate", prompt=system + prompt, **common)
    else:
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
        turn = Turn(api="ollama.generate", messages=tuple(messages), **common)
    return turn, _think(body), keep_alive(body.get("keep_alive"))


# --- answers -------------------------------------------------------------------------------------


def _done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


def _final_fields(started: Started, finished: Finished, began: float) -> dict[str, Any]:
    usage = finished.usage
    elapsed = time.monotonic() - began
    return {
        "done": True,
        "done_reason": _done_reason(finished.finish),
        "total_duration": int(elapsed * 1e9),
        "load_duration": 0,
        "prompt_eval_count": usage.computed_tokens,
        "prompt_eval_duration": int(usage.prefill_ms * 1e6),
        "eval_count": usage.completion_tokens,
        "eval_duration": int(usage.decode_ms * 1e6),
        "modeld": {
            "session_id": started.session_id,
            "reuse": started.status.reuse.outcome,
            "reason": started.status.reuse.reason,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
        },
    }


def _calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = {}
        out.append({"id": call.id or new_call_id(), "function": {"name": call.name, "arguments": arguments}})
    return out


def _line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def chat_complete(turn: Turn, done: Collected, think: bool, began: float) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.reasoning and think:
        message["thinking"] = done.reasoning
    if done.finished.calls:
        message["tool_calls"] = _calls(done.finished.calls)
    return {
        "model": turn.model,
        "created_at": _now(),
        "message": message,
        **_final_fields(done.started, done.finished, began),
    }


def generate_complete(turn: Turn, done: Collected, think: bool, began: float) -> dict[str, Any]:
    out: dict[str, Any] = {"model": turn.model, "created_at": _now(), "response": done.text}
    if done.reasoning and think:
        out["thinking"] = done.reasoning
    return {**out, **_final_fields(done.started, done.finished, began)}


async def _stream(
    turn: Turn, started: Started, events: AsyncIterator[Event], think: bool, began: float, chat: bool
) -> AsyncIterator[bytes]:
    async for event in events:
        if isinstance(event, Delta):
            thinking = event.reasoning if think else ""
            if not (event.text or thinking):
                continue
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": event.text}
                if thinking:
                    message["thinking"] = thinking
                yield _line({"model": turn.model, "created_at": _now(), "message": message, "done": False})
            else:
                piece: dict[str, Any] = {
                    "model": turn.model,
                    "created_at": _now(),
                    "response": event.text,
                    "done": False,
                }
                if thinking:
                    piece["thinking"] = thinking
                yield _line(piece)
        elif isinstance(event, Finished):
            if event.error is not None:
                yield _line(ollama_error(event.error))
                return
            final = _final_fields(started, event, began)
            if chat:
                message = {"role": "assistant", "content": ""}
                if event.calls:
                    message["tool_calls"] = _calls(event.calls)
                yield _line({"model": turn.model, "created_at": _now(), "message": message, **final})
            else:
                yield _line({"model": turn.model, "created_at": _now(), "response": "", **final})
            return


# --- models --------------------------------------------------------------------------------------


def _details(info: ModelInfo | None) -> dict[str, Any]:
    family = info.architecture if info is not None else ""
    return {
        "parent_model": "",
        "format": "gguf"
        if info is not None and info.backend in ("llama", "openvino")
        else (info.backend if info else ""),
        "family": family,
        "families": [family] if family else [],
        "parameter_size": "",
        "quantization_level": "",
    }


def _modified(entry: ModelEntry) -> str:
    return datetime.fromtimestamp(entry.created, UTC).isoformat().replace("+00:00", "Z")


def _digest(info: ModelInfo | None) -> str:
    return info.model_digest if info is not None else ""


def routes(service: HttpService) -> list[Route]:
    async def version(_request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def tags(_request: Request) -> Response:
        models = []
        for entry in service.registry.entries():
            info = await service.describe(entry)
            models.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "modified_at": _modified(entry),
                    "size": info.weights_bytes if info is not None else 0,
                    "digest": _digest(info),
                    "details": _details(info),
                }
            )
        return JSONResponse({"models": models})

    async def show(request: Request) -> Response:
        async with service.body(request) as body:
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise bad("model", "model is required")
            entry = service.entry(name.removesuffix(":latest"))
        info = await service.describe(entry)
        if info is None:
            raise HttpError(500, f"the model {echo(entry.name)} could not be read", code="model_load_failed")
        arch = info.architecture or info.backend
        capabilities = ["completion"]
        if info.tool_format:
            capabilities.append("tools")
        if info.reasoning_format:
            capabilities.append("thinking")
        return JSONResponse(
            {
                "modelfile": f"# served by modeld\nFROM {entry.name}\nPARAMETER num_ctx {info.effective_context}\n",
                "parameters": f"num_ctx {info.effective_context}",
                "template": info.chat_template,
                "details": _details(info),
                "model_info": {
                    "general.architecture": arch,
                    "general.name": info.model_name,
                    f"{arch}.context_length": info.effective_context,
                    "modeld.trained_context_length": info.model_max_context,
                    # What it takes in memory here (``modeld describe``): weights, KV per
                    # token, the layout's KV and compute, the total, the largest window.
                    **{f"modeld.{k}": v for k, v in asdict(info.footprint).items()},
                    # Which chat template it renders with (GET /v1/models says the same).
                    **{f"modeld.chat_template.{k}": v for k, v in template_meta(info).items()},
                },
                "capabilities": capabilities,
                "modified_at": _modified(entry),
            }
        )

    async def ps(_request: Request) -> Response:
        status = await service.bridge.observe(service.gateway.status, "ps")
        names = {e.path: e.name for e in service.registry.entries()}
        models = []
        for m in status.models:
            name = names.get(m.path, m.model_name)
            models.append(
                {
                    "name": name,
                    "model": name,
                    "size": m.pool_tokens * m.kv_bytes_per_token,
                    "size_vram": 0,
                    "digest": m.model_digest,
                    "details": {"format": "gguf" if m.backend in ("llama", "openvino") else m.backend},
                    "expires_at": None,
                    "context_length": m.n_ctx,
                    "modeld": {
                        "backend": m.backend,
                        "sessions": m.sessions,
                        "contexts": [
                            {
                                "id": c.id,
                                "tier": c.tier,
                                "tokens": c.tokens,
                                "bytes": c.bytes,
                                "pinned": c.pinned,
                            }
                            for c in m.contexts
                        ],
                    },
                }
            )
        return JSONResponse({"models": models})

    async def chat(request: Request) -> Response:
        began = time.monotonic()
        async with service.body(request) as body:
            turn, think, alive = parse_chat(body, request.headers, service.gateway.limits)
            return await _run(service, request, turn, think, alive, began, chat=True)

    async def generate(request: Request) -> Response:
        began = time.monotonic()
        async with service.body(request) as body:
            turn, think, alive = parse_generate(body, request.headers, service.gateway.limits)
            if not body.get("prompt"):  # an empty prompt only loads the model (Ollama's preload)
                await service.load(turn)
                return JSONResponse(
                    {
                        "model": turn.model,
                        "created_at": _now(),
                        "response": "",
                        "done": True,
                        "done_reason": "load",
                    }
                )
            return await _run(service, request, turn, think, alive, began, chat=False)

    return [
        Route("/api/version", guarded(service, version, ollama_error), methods=["GET", "HEAD"]),
        Route("/api/tags", guarded(service, tags, ollama_error), methods=["GET", "HEAD"]),
        Route("/api/show", guarded(service, show, ollama_error), methods=["POST"]),
        Route("/api/ps", guarded(service, ps, ollama_error), methods=["GET"]),
        Route("/api/chat", guarded(service, chat, ollama_error), methods=["POST"]),
        Route("/api/generate", guarded(service, generate, ollama_error), methods=["POST"]),
    ]


async def _run(
    service: HttpService,
    request: Request,
    turn: Turn,
    think: bool,
    alive: float | None,
    began: float,
    *,
    chat: bool,
) -> Response:
    def complete(t: Turn, done: Collected) -> dict[str, Any]:
        return chat_complete(t, done, think, began) if chat else generate_complete(t, done, think, began)

    return await service.turn(
        request,
        turn,
        complete,
        lambda t, s, e: _stream(t, s, e, think, began, chat),
        ollama_error,
        media_type="application/x-ndjson",
        keep_alive=alive,
    )
