"""Every model family's template, over every API, turn after turn, warm (issue 31).

The models are REPLY with each family's template and tokens (``modeld.testmodels.families``),
served by a real daemon on llama.cpp. Each family runs a 3-turn agent conversation over OpenAI
chat, OpenAI Responses, Anthropic Messages and Ollama, each with the vendor's own SDK: a system
prompt with tools and a question; then the assistant's call (with its reasoning) and the tool's
result; then the assistant's answer and a new question. Checked on every turn:

* the request succeeds (2xx);
* the prompt has exactly the tokens of the whole conversation as the family's template renders
  it (the oracle test below holds that rendering to llama-server's ``/apply-template``);
* the turn reuses everything of the previous turn's prompt the template did not render
  otherwise (the longest common token prefix of the two renderings); it may reuse more, from
  another API's conversation that rendered the same prompt before it (reuse is by tokens, from
  every warm context of the model).

Gemma 3's template has no tools and refuses a tool result (its roles must alternate): its
conversation has no call, and a request with a tool result gets a 400 with the template's words.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest

from modeld.cache.reuse import common_prefix_len
from modeld.contract import ToolCall
from modeld.engine.chat import ChatRenderer, Message
from modeld.engine.chat_env import TemplateRefusedError
from modeld.manifest import token_hash
from modeld.server.http.turn import Message as TurnMessage
from modeld.server.http.turn import message_json
from modeld.testmodels.families import FAMILIES, Family, ensure_family_model
from tests.daemon_proc import modeld, serve_http, stop

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.wire, pytest.mark.llama]

BUILD_SECONDS = 3600
"""A test that needs llama-server may wait for its first build (~10 minutes on 2 cores)."""

SYSTEM = "You are a coding agent working in a Python repository. Read files before you answer. " * 8
ASK = "Why does main() crash?"
REASONING = "The traceback points at main.py; read it first."
ARGS = {"path": "main.py"}
CALL_ID = "call00001"  # 9 alphanumerics: Mistral's template refuses any other id
RESULT = "def main():\n    return 1 / 0\n"
ANSWER = "It divides by zero."
FIX = "Fix it."
TOOL = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "The file's path."}},
        "required": ["path"],
    },
}
MAX_TOKENS = 4


def conversation(fam: Family, turn: int, api: str = "") -> list[TurnMessage]:
    """The conversation of turn 1, 2 or 3, as every API's request parses to (Ollama's tool
    result names its function: ``tool_name`` is how Ollama says which call it answers)."""
    out = [TurnMessage("system", SYSTEM), TurnMessage("user", ASK)]
    if turn >= 2:
        if fam.tools:
            call = ToolCall(CALL_ID, TOOL["name"], json.dumps(ARGS))  # type: ignore[arg-type]
            out += [
                TurnMessage("assistant", "", (call,), REASONING),
                TurnMessage(
                    "tool", RESULT, tool_call_id=CALL_ID, name=TOOL["name"] if api == "ollama" else ""
                ),  # type: ignore[arg-type]
            ]
        else:
            out += [TurnMessage("assistant", ANSWER), TurnMessage("user", FIX)]
    if turn >= 3:
        out += [TurnMessage("assistant", ANSWER), TurnMessage("user", FIX)]
    return out


def render(
    fam: Family, messages: list[TurnMessage], args: dict[str, Any] | None = None, *, tools: bool = True
) -> str:
    """The whole conversation as the family's template renders it (what modeld evaluates)."""
    whole = [Message(m.role, m.content, (), message_json(m)) for m in messages]
    renderer = ChatRenderer(fam.template, bos_token=fam.bos or "<|endoftext|>", eos_token=fam.eos)
    given = [{"type": "function", "function": TOOL}] if fam.tools and tools else None
    return renderer.render(whole, given, add_generation_prompt=True, args=args)


class Vocab:
    """A family model's tokenizer (llama.cpp, vocabulary only)."""

    def __init__(self, fam: Family) -> None:
        self.fam = fam
        self.model = llama_cpp.Llama(str(ensure_family_model(fam.name)), vocab_only=True, verbose=False)

    def tokens(self, text: str) -> list[int]:
        bos = self.fam.bos
        add = self.fam.add_bos and not (bos and text.startswith(bos))
        return list(self.model.tokenize(text.encode(), add_bos=add, special=True))


# --- the four APIs, each with its vendor's SDK ------------------------------------------------


class Clients:
    """One client of each SDK for the daemon (closed with it)."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url = url
        self.data_dir = data_dir
        self.last_session = ""  # the session of the last OpenAI chat turn
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        self.ollama = ollama.Client(host=url, timeout=120)  # its conversations are told apart by model

    def close(self) -> None:
        self.openai.close()
        self.anthropic.close()
        self.ollama._client.close()


def openai_chat(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.openai
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        call = {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": TOOL["name"], "arguments": json.dumps(ARGS)},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": REASONING},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    done = client.chat.completions.create(
        model=fam.name,
        messages=messages,
        tools=[{"type": "function", "function": TOOL}] if fam.tools else openai.NOT_GIVEN,  # type: ignore[list-item]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Modeld-Conversation": f"{fam.name}-chat"},
    )
    usage = done.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    clients.last_session = (done.model_extra or {})["modeld"]["session_id"]
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def openai_responses(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.openai
    items: list[Any] = [{"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        items += [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": REASONING}]},
            {
                "type": "function_call",
                "call_id": CALL_ID,
                "name": TOOL["name"],
                "arguments": json.dumps(ARGS),
            },
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
        ]
    elif turn >= 2:
        items += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        items += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    done = client.responses.create(
        model=fam.name,
        instructions=SYSTEM,
        input=items,
        tools=[{"type": "function", **TOOL, "strict": False}] if fam.tools else openai.NOT_GIVEN,  # type: ignore[list-item]
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
        prompt_cache_key=f"{fam.name}-responses",
    )
    assert done.usage is not None
    return done.usage.input_tokens, done.usage.input_tokens_details.cached_tokens


def anthropic_messages(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.anthropic
    messages: list[Any] = [{"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": REASONING, "signature": ""},
                    {"type": "tool_use", "id": CALL_ID, "name": TOOL["name"], "input": ARGS},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": RESULT}]},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    tools: Any = (
        [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
        if fam.tools
        else anthropic.NOT_GIVEN
    )
    done = client.messages.create(
        model=fam.name,
        system=SYSTEM,
        messages=messages,
        tools=tools,
        max_tokens=MAX_TOKENS,
        extra_headers={"X-Modeld-Conversation": f"{fam.name}-anthropic"},
    )
    u = done.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    return prompt, u.cache_read_input_tokens or 0


def ollama_chat(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.ollama
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        messages += [
            {
                "role": "assistant",
                "content": "",
                "thinking": REASONING,
                "tool_calls": [{"function": {"name": TOOL["name"], "arguments": ARGS}}],
            },
            {"role": "tool", "tool_name": TOOL["name"], "content": RESULT},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    done = client.chat(
        model=fam.name,
        messages=messages,
        tools=[{"type": "function", "function": TOOL}] if fam.tools else None,
        options={"num_predict": MAX_TOKENS, "temperature": 0},
        stream=False,
    )
    # Ollama's client keeps no extension: prompt_eval_count is what this turn computed (modeld
    # counts as Ollama's llama-server does), so the prompt is checked by the other APIs.
    return -1, done.prompt_eval_count or 0


APIS: dict[str, Callable[[Clients, Family, int], tuple[int, int]]] = {
    "openai-chat": openai_chat,
    "responses": openai_responses,
    "anthropic": anthropic_messages,
    "ollama": ollama_chat,
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Clients]:
    tmp = Path(tempfile.mkdtemp(prefix="mdfam"))
    models = [f"--model={f.name}={ensure_family_model(f.name)}" for f in FAMILIES]
    proc, record = serve_http(
        tmp, *models, "--max-output-tokens", str(MAX_TOKENS), backend="llama", timeout=300
    )
    clients = Clients(record.http_endpoint, tmp)
    try:
        yield clients
    finally:
        clients.close()
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_three_turn_agent_conversation_is_warm_over_every_api(daemon: Clients, fam: Family) -> None:
    vocab = Vocab(fam)
    for api, run in APIS.items():
        renderings = [vocab.tokens(render(fam, conversation(fam, t, api))) for t in (1, 2, 3)]
        previous: list[int] | None = None
        for t in (1, 2, 3):
            prompt, cached = run(daemon, fam, t)
            expected = renderings[t - 1]
            if prompt < 0:  # Ollama: the computed count, not the prompt
                prompt, cached = len(expected), len(expected) - cached
            assert prompt == len(expected), (
                f"{fam.name} over {api}, turn {t}: the prompt is not the template's rendering"
            )
            if previous is not None:
                kept = common_prefix_len(previous, expected)  # what the template did not render otherwise
                assert kept <= cached <= len(expected), f"{fam.name} over {api}, turn {t}: reuse"
            previous = expected
            if api == "openai-chat" and t == 3:  # token for token: the session's resident prompt
                assert_resident(daemon, expected)


def assert_resident(daemon: Clients, expected: list[int]) -> None:
    """The last chat turn's session holds exactly ``expected`` as its prompt: its prefix's and
    suffix's token hashes are those of the whole rendering tokenized whole, cut where it says."""
    shown = modeld("explain-context", daemon.last_session, "--json", data_dir=daemon.data_dir)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    report = report.get("report", report)
    n = report["prefix_tokens"]
    assert report["prefix_tokens"] + report["suffix_tokens"] == len(expected)
    assert report["stable_token_hash"] == token_hash(expected[:n])
    assert report["volatile_token_hash"] == token_hash(expected[n:])


def test_a_template_that_refuses_a_conversation_answers_400_with_its_words(daemon: Clients) -> None:
    client = daemon.openai
    call = {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": TOOL["name"], "arguments": json.dumps(ARGS)},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gemma3",
            messages=[
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
                {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
            ],
            max_tokens=MAX_TOKENS,
        )
    assert err.value.status_code == 400
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in err.value.message
    with pytest.raises(anthropic.BadRequestError) as refused:  # Mistral wants call ids of 9 characters
        daemon.anthropic.messages.create(
            model="mistral-small",
            max_tokens=MAX_TOKENS,
            messages=[
                {"role": "user", "content": ASK},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": ARGS}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}],
                },
            ],
        )
    assert "Tool call IDs should be alphanumeric strings with length 9!" in refused.value.message


def test_every_api_names_the_template_a_model_renders_with(daemon: Clients) -> None:
    listed = {m.id: (m.model_extra or {})["modeld"]["chat_template"] for m in daemon.openai.models.list()}
    assert set(listed) == {f.name for f in FAMILIES}
    assert listed["qwen3"]["source"] == "model" and listed["qwen3"]["tool_format"] == "hermes"
    assert listed["qwen3"]["reasoning_format"] and not listed["qwen3-coder"]["reasoning_format"]
    assert listed["qwen3.5"]["reasoning_format"] == "think-open"  # its generation prompt opens <think>
    shown = daemon.ollama.show("qwen3")
    assert shown.modelinfo is not None and shown.modelinfo["modeld.chat_template.source"] == "model"
    assert "thinking" in (shown.capabilities or [])


# --- the oracle: llama-server's own rendering ---------------------------------------------------


def llama_server_binary() -> str:
    """llama-server built from the vendored llama.cpp, as the bench builds it (cached; the
    first build takes ~10 minutes), or a skip saying why it cannot be had."""
    given = os.environ.get("MODELD_LLAMA_SERVER", "")
    if given:
        return given
    script = Path(__file__).resolve().parent.parent / "scripts" / "build_llama_server.sh"
    cached = subprocess.run([str(script), "--cached-only"], capture_output=True, text=True, check=False)
    if cached.returncode == 0 and cached.stdout.strip():
        return cached.stdout.strip().splitlines()[-1]
    built = subprocess.run([str(script)], capture_output=True, text=True, check=False, timeout=BUILD_SECONDS)
    if built.returncode != 0 or not built.stdout.strip():
        pytest.skip(f"llama-server could not be built here: {built.stderr.strip()[-400:]}")
    return built.stdout.strip().splitlines()[-1]


class LlamaServer:
    def __init__(self, binary: str, model: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(model),
                "--jinja",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "-c",
                "4096",
                "-np",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not start (exit {self.proc.returncode})")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def openai_messages(messages: list[TurnMessage]) -> list[dict[str, Any]]:
    """The conversation as the OpenAI messages llama-server's /apply-template takes."""
    return [json.loads(message_json(m)) for m in messages]


@pytest.fixture(scope="module")
def llama_server() -> str:
    return llama_server_binary()


# Where llama-server renders otherwise, and which is right. None left; what differed in the
# first runs (blueprints/0010): the default of enable_thinking and date_string (modeld now gives
# a template what llama-server gives it), a Gemma 4 template without the comment that marks it
# as taking OpenAI-style tool messages (llama-server rewrites such a template's messages: ours
# now carries it, as the current real one does), and dict.update, which llama.cpp's Jinja lacks
# (our Command R template no longer uses it; modeld's environment has it).
KNOWN: dict[str, str] = {}


@pytest.mark.slow
@pytest.mark.timeout(BUILD_SECONDS)
@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_modelds_prompt_is_llama_servers_rendering(llama_server: str, fam: Family) -> None:
    """For every turn of the conversation, with thinking as the request leaves it and turned off:
    the text modeld evaluates equals what llama-server (``--jinja``) answers on ``POST
    /apply-template``, and so do their tokens (llama-server drops a BOS the template wrote and
    adds its own; modeld does not add a second one)."""
    vocab = Vocab(fam)
    server = LlamaServer(llama_server, ensure_family_model(fam.name))
    try:
        for args in ({}, {"enable_thinking": False}):
            for t in (1, 2, 3):
                messages = conversation(fam, t)
                body: dict[str, Any] = {"messages": openai_messages(messages), "chat_template_kwargs": args}
                if fam.tools:
                    body["tools"] = [{"type": "function", "function": TOOL}]
                theirs = server.post("/apply-template", body)["prompt"]
                whole = render(fam, messages, args)
                ours = (
                    whole[len(fam.bos) :] if fam.bos and fam.add_bos and whole.startswith(fam.bos) else whole
                )
                if fam.name in KNOWN:
                    assert ours != theirs, f"{fam.name}: the known difference is gone: {KNOWN[fam.name]}"
                    continue
                assert ours == theirs, f"{fam.name}, turn {t}, {args}"
                assert vocab.tokens(whole) == vocab.tokens(theirs)
    finally:
        server.close()


def test_thinking_off_reaches_the_template_over_every_api(daemon: Clients) -> None:
    """Qwen3.5's generation prompt opens <think>; with thinking off it closes an empty one, so
    the turn spends no tokens thinking. Each API's own words for "off" reach the template."""
    fam = next(f for f in FAMILIES if f.name == "qwen3.5")
    vocab = Vocab(fam)
    messages = [TurnMessage("system", SYSTEM), TurnMessage("user", "Answer at once: 2 + 2?")]
    off = len(vocab.tokens(render(fam, messages, {"enable_thinking": False}, tools=False)))
    on = len(vocab.tokens(render(fam, messages, tools=False)))
    assert off > on  # "\n\n</think>\n\n" closes the block the prompt opened
    chat = daemon.openai.chat.completions.create(
        model=fam.name,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Answer at once: 2 + 2?"},
        ],
        max_tokens=1,
        reasoning_effort="none",
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == off
    kwargs = daemon.openai.chat.completions.create(
        model=fam.name,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Answer at once: 2 + 2?"},
        ],
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert kwargs.usage is not None and kwargs.usage.prompt_tokens == off
    responses = daemon.openai.responses.create(
        model=fam.name,
        instructions=SYSTEM,
        input="Answer at once: 2 + 2?",
        max_output_tokens=1,
        reasoning={"effort": "none"},  # type: ignore[typeddict-item]
        store=False,
    )
    assert responses.usage is not None and responses.usage.input_tokens == off
    message = daemon.anthropic.messages.create(
        model=fam.name,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Answer at once: 2 + 2?"}],
        max_tokens=1,
        thinking={"type": "disabled"},
    )
    u = message.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == off


def variants() -> dict[str, list[TurnMessage]]:
    """Conversations that test what templates read or refuse beyond the agent loop."""
    first = ToolCall(CALL_ID, TOOL["name"], json.dumps(ARGS))  # type: ignore[arg-type]
    second = ToolCall("call00002", TOOL["name"], json.dumps({"path": "test_main.py"}))  # type: ignore[arg-type]
    return {
        "parallel calls": [
            TurnMessage("system", SYSTEM),
            TurnMessage("user", ASK),
            TurnMessage("assistant", "", (first, second)),
            TurnMessage("tool", RESULT, tool_call_id=CALL_ID),
            TurnMessage("tool", "def test(): main()", tool_call_id="call00002"),
            TurnMessage("assistant", ANSWER),
            TurnMessage("user", FIX),
        ],
        "content parts": [
            TurnMessage("system", SYSTEM),
            TurnMessage("user", "Look:\nmain.py crashes", parts=("Look:", "main.py crashes")),
            TurnMessage("assistant", ANSWER),
            TurnMessage("user", FIX),
        ],
        "a system message later": [
            TurnMessage("system", SYSTEM),
            TurnMessage("user", ASK),
            TurnMessage("assistant", ANSWER),
            TurnMessage("system", "Reminder: be brief."),
            TurnMessage("user", FIX),
        ],
        "no system message": [
            TurnMessage("user", ASK),
            TurnMessage("assistant", ANSWER),
            TurnMessage("user", FIX),
        ],
    }


@pytest.mark.slow
@pytest.mark.timeout(BUILD_SECONDS)
@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_harder_conversations_render_as_llama_server_renders_them_or_both_refuse(
    llama_server: str, fam: Family
) -> None:
    """Parallel calls, content parts, a system message in the middle, none at all: the same
    text as llama-server's, or both refuse (the template raises: Llama 3.3 takes one call per
    message, Qwen3.5 a system message only first, Mistral and Gemma 3 alternating roles; modeld
    answers 400 with the template's words, llama-server 400 or, for Qwen3.5's, 500)."""
    server = LlamaServer(llama_server, ensure_family_model(fam.name))
    try:
        for name, messages in variants().items():
            body: dict[str, Any] = {"messages": openai_messages(messages)}
            if fam.tools:
                body["tools"] = [{"type": "function", "function": TOOL}]
            theirs: str | None = None  # llama-server refuses with a 4xx or a 500 (Qwen3.5's raise)
            try:
                theirs = server.post("/apply-template", body)["prompt"]
            except urllib.error.HTTPError as err:
                err.close()
            whole: str | None = None
            with contextlib.suppress(TemplateRefusedError):  # the template refused
                whole = render(fam, messages)
            if whole is None or theirs is None:
                assert whole is None and theirs is None, f"{fam.name}, {name}: only one of them refused"
                continue
            ours = whole[len(fam.bos) :] if fam.bos and fam.add_bos and whole.startswith(fam.bos) else whole
            assert ours == theirs, f"{fam.name}, {name}"
    finally:
        server.close()


def chat_messages(fam: Family, turn: int, system: str) -> list[Any]:
    """The conversation of ``turn`` as OpenAI chat messages (what both servers are sent)."""
    messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        call = {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": TOOL["name"], "arguments": json.dumps(ARGS)},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": REASONING},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    return messages


@pytest.mark.slow
@pytest.mark.timeout(BUILD_SECONDS)
@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_no_family_recomputes_more_than_llama_server(daemon: Clients, llama_server: str, fam: Family) -> None:
    """The same three turns, byte for byte, on modeld and on llama-server (``--jinja``, one
    slot, prompt caching on): each turn's prompt has the same tokens, and modeld computes no more
    of them than llama-server does (measured here: exactly as many on every family and turn,
    llama-server's rule being the same). llama-server answers 500 for gpt-oss and Command R (its
    parser refuses output not in their format): those turns are compared on modeld's side only."""
    system = f"Conversation {fam.name}-parity. {SYSTEM}"  # no earlier test warmed this text
    tools = [{"type": "function", "function": TOOL}] if fam.tools else openai.NOT_GIVEN
    server = LlamaServer(llama_server, ensure_family_model(fam.name))
    theirs = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        for t in (1, 2, 3):
            messages = chat_messages(fam, t, system)
            ours = daemon.openai.chat.completions.create(
                model=fam.name,
                messages=messages,
                tools=tools,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_headers={"X-Modeld-Conversation": f"{fam.name}-parity"},
            ).usage
            assert ours is not None and ours.prompt_tokens_details is not None
            refused = ""
            try:
                peer = theirs.chat.completions.create(
                    model=fam.name, messages=messages, tools=tools, max_tokens=MAX_TOKENS, temperature=0
                ).usage
            except openai.InternalServerError as err:
                refused = err.message
            if refused:
                assert "does not match the expected" in refused, f"{fam.name}, turn {t}"
                continue
            assert peer is not None and peer.prompt_tokens_details is not None
            assert ours.prompt_tokens == peer.prompt_tokens, f"{fam.name}, turn {t}"
            computed = ours.prompt_tokens - (ours.prompt_tokens_details.cached_tokens or 0)
            peer_computed = peer.prompt_tokens - (peer.prompt_tokens_details.cached_tokens or 0)
            assert computed <= peer_computed, f"{fam.name}, turn {t}"
    finally:
        theirs.close()
        server.close()
