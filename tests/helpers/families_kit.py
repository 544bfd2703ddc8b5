"""What the family tests share (``tests/models/test_families.py``, ``tests/models/test_families_oracle.py``):
the conversation every API runs, its rendering by the family's template, the family model's
tokenizer, one client of each SDK, a daemon serving every family, and llama-server (built as the
bench builds it) with its ``/apply-template``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest
from daemon_proc import serve_http, stop

from modeld.contract import ToolCall
from modeld.engine.chat import ChatRenderer, Message
from modeld.server.http.turn import Message as TurnMessage
from modeld.server.http.turn import message_json
from modeld.testmodels.families import FAMILIES, Family, ensure_family_model

llama_cpp = pytest.importorskip("llama_cpp")

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


def llama_server_binary() -> str:
    """llama-server built from the vendored llama.cpp, as the bench builds it (cached; the
    first build takes ~10 minutes), or a skip saying why it cannot be had."""
    given = os.environ.get("MODELD_LLAMA_SERVER", "")
    if given:
        return given
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_server.sh"
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


@contextlib.contextmanager
def serve_families() -> Iterator[Clients]:
    """A daemon on llama.cpp serving every family model under its name, and its clients.

    Without the prefill ahead of the next turn: these conversations are scripted (a turn's
    history is the script's, not what the model answered), so a prefill ahead would predict a
    next turn they never send and move each session off the rendering the matrix checks, turn
    by turn; ``tests/http/test_prefill_ahead.py`` tests it on a conversation that goes on from
    the model's own answer."""
    tmp = Path(tempfile.mkdtemp(prefix="mdfam"))
    models = [f"--model={f.name}={ensure_family_model(f.name)}" for f in FAMILIES]
    proc, record = serve_http(
        tmp,
        *models,
        "--max-output-tokens",
        str(MAX_TOKENS),
        "--no-prefill-ahead",
        backend="llama",
        timeout=300,
    )
    clients = Clients(record.http_endpoint, tmp)
    try:
        yield clients
    finally:
        clients.close()
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
