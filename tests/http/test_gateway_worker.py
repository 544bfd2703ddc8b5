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


def _loads(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SGLang's /get_load entry, smg's /v1/loads rank)."""
    (load,) = httpx.get(f"{url}/get_load", timeout=10).json()
    loads = httpx.get(f"{url}/v1/loads?include=core,disagg,queues,memory", timeout=10).json()
    assert loads["dp_rank_count"] == 1 and loads["timestamp"]
    (rank,) = loads["loads"]
    return load, rank


def test_the_load_counts_running_work_not_the_warm_cache(url: str) -> None:
    assert chat(url).status_code == 200
    load, rank = _loads(url)
    assert set(load) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    # Nothing runs now: the warm context the turn left is a cache that gives way, not load.
    assert load["num_reqs"] == load["num_waiting_reqs"] == load["num_tokens"] == 0
    assert 0 < load["resident_tokens"] <= load["kv_capacity_tokens"]
    assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == rank["num_used_tokens"] == 0
    assert rank["token_usage"] == rank["utilization"] == 0.0
    assert rank["max_total_num_tokens"] == load["kv_capacity_tokens"] and rank["max_running_requests"] >= 1

    # A turn that decodes for a few seconds (the memory backend's delay_ms): it is the load.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer, please " * 20}],
        "max_tokens": 40,
        "delay_ms": 100,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # it runs
        load, rank = _loads(url)
        assert load["num_reqs"] == 1 and load["busy_slots"] == 1 and load["num_tokens"] > 0
        assert rank["num_running_reqs"] == 1 and rank["num_used_tokens"] == load["num_tokens"]
        assert rank["token_usage"] == rank["num_used_tokens"] / rank["max_total_num_tokens"]
        assert rank["utilization"] == 1 / rank["max_running_requests"]
        assert [line for line in lines if line][-1] == "data: [DONE]"
    load, rank = _loads(url)
    assert load["num_reqs"] == load["num_tokens"] == rank["num_used_tokens"] == 0
    assert chat(url).status_code == 200  # the first turn again: its prompt is reused
    assert 0 < _loads(url)[1]["cache_hit_rate"] < 1


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
