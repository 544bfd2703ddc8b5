"""modeld as a worker of the SGLang model gateway: the routes it registers workers from, the
load it places by, the fields its routers inject, and the routing key it routes on (a real
``modeld serve --http``, memory backend)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemon_proc import serve_http, stop

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
SGLANG_DEFAULTS = {
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="mdg"))
    proc, record = serve_http(tmp)
    try:
        yield record.http_endpoint
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def chat(url: str, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_server_and_model_info_in_sglangs_shape(url: str) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(url + path, timeout=10).json()
        assert info["model_path"] == info["served_model_name"] == MODEL
        assert info["max_total_tokens"] > 0 and info["max_running_requests"] >= 1 and info["version"]
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(url + path, timeout=10).json()
        assert (
            info["model_path"] == MODEL and info["is_generation"] is True and info["model_type"] == "memory"
        )


def test_the_load_report_counts_what_the_daemon_holds(url: str) -> None:
    assert chat(url).status_code == 200
    (load,) = httpx.get(f"{url}/get_load", timeout=10).json()
    assert set(load) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0  # nothing running now
    assert load["num_tokens"] > 0 and load["kv_capacity_tokens"] >= load["num_tokens"]


def test_the_routers_injected_fields_are_accepted_at_their_defaults_only(url: str) -> None:
    assert chat(url, **SGLANG_DEFAULTS, max_completion_tokens=2).status_code == 200
    for name, default in SGLANG_DEFAULTS.items():
        refused = chat(url, **{name: not default})
        assert refused.status_code == 400, name
        assert refused.json()["error"]["param"] == name


def test_the_routing_key_names_the_conversation(url: str) -> None:
    first = chat(url, headers={"X-SMG-Routing-Key": "agent-7"}).json()["modeld"]
    again = chat(url, headers={"X-SMG-Routing-Key": "agent-7"}).json()["modeld"]
    other = chat(url, headers={"X-SMG-Routing-Key": "agent-8"}).json()["modeld"]
    assert first["session_id"] == again["session_id"] != other["session_id"]
    # The explicit header comes first, then the routing key, then prompt_cache_key.
    explicit = chat(url, headers={"X-SMG-Routing-Key": "agent-7", "X-Modeld-Conversation": "mine"}).json()[
        "modeld"
    ]
    assert explicit["session_id"] != first["session_id"]
    keyed = chat(url, headers={"X-SMG-Routing-Key": "agent-7"}, prompt_cache_key="other").json()["modeld"]
    assert keyed["session_id"] == first["session_id"]
