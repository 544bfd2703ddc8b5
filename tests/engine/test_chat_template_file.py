"""``--chat-template-file NAME=PATH``: a model rendered with another template than its file's
(llama-server's flag, per model), and every API saying which template it renders with.

A real ``modeld serve --http`` on the memory backend (one token per byte plus BOS, so the
prompt's length is the rendering's), with the OpenAI and Ollama SDKs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest
from daemon_proc import serve_http, start_serve, stop

from modeld.manifest import bytes_hash

pytestmark = pytest.mark.wire

TEMPLATE = (
    "{%- for m in messages %}<<{{ m.role }}>>{{ m.content }}<</{{ m.role }}>>{%- endfor %}"
    "{%- if add_generation_prompt %}<<assistant>>{%- endif %}"
)


@pytest.fixture
def served() -> Iterator[tuple[str, Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="mdtpl"))
    template = tmp / "plain.jinja"
    template.write_text(TEMPLATE)
    proc, record = serve_http(
        tmp, "--model", "plain=agent", "--model", "stock=agent", "--chat-template-file", f"plain={template}"
    )
    try:
        yield record.http_endpoint, tmp
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_named_model_renders_with_the_file_and_every_api_says_so(served: tuple[str, Path]) -> None:
    url, _tmp = served
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        listed = {m.id: (m.model_extra or {})["modeld"]["chat_template"] for m in client.models.list()}
        assert listed["plain"] == {
            "source": "override",
            "digest": bytes_hash(TEMPLATE),
            "tool_format": "",
            "reasoning_format": "",
        }
        assert listed["stock"]["source"] == "model" and listed["stock"]["tool_format"] == "hermes"
        done = client.chat.completions.create(
            model="plain",
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            max_tokens=1,
        )
        rendered = "<<system>>Be brief.<</system>><<user>>hi<</user>><<assistant>>"
        assert done.usage is not None and done.usage.prompt_tokens == len(rendered) + 1  # + BOS
    local = ollama.Client(host=url)
    shown = local.show("plain")
    local._client.close()
    assert shown.modelinfo is not None
    assert shown.modelinfo["modeld.chat_template.source"] == "override"
    assert shown.template == TEMPLATE


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("plain", "--chat-template-file wants NAME=PATH"),
        ("plain=/nonexistent/t.jinja", "--chat-template-file plain=/nonexistent/t.jinja"),
    ],
)
def test_a_bad_template_file_is_one_line_at_serve(spec: str, words: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdtpl"))
    try:
        proc = start_serve(tmp, tmp / "s.sock", "--http", "127.0.0.1:0", "--chat-template-file", spec)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (out, err)
        assert words in err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
