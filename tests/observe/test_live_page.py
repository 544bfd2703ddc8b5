"""The live page in a real browser: the distribution's headless Chromium, driven by Playwright
(pointed at the system browser; its own browser download is not used), against a daemon serving
the generated tiny model through llama.cpp while a scripted agent runs.

The agent plays the demo's four turns over the OpenAI API (cold; warm; an edit inside the system
prompt; warm again) under a job label, a gRPC session runs two turns, and one long decode runs
while the page watches. The page, opened with the API key as a real user opens it, must show
the running turn, every conversation, the agent's four turns as bars with the edit's reason and
segment, numbers whose sums equal ``/metrics`` exactly, sorting, filtering and the search by job.
A screenshot is kept as the test's artifact (``MODELD_SCREENSHOT=path`` also writes it there:
the README's ``docs/live-page.png`` is made so).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from daemon_proc import serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld import testmodels
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput

pytestmark = [pytest.mark.llama, pytest.mark.wire]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "page-test-key"
JOB = "browser-agent"
WINDOW = 16384
"""The gRPC sessions' window: room for a long decode that outlasts the page's checks (the tiny
model decodes ~1,700 tokens a second on a quiet box: 1,500 tokens ended before the other turn
was seen waiting)."""
SYSTEM = (
    "You are a careful senior engineer working in this repository. Answer with a unified diff.\n"
    "repo map:\nmodeld/lease.py: Lease, acquire, release, read_lease\nmodeld/paths.py: default_data_dir\n"
    "modeld/engine/session.py: EngineSession, ensure_prefix, prefill_suffix, decode\n"
) * 3


def _browser() -> Any:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"no Chromium at {CHROMIUM}: .ci/run installs Debian's chromium package")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def _metric_totals(text: str) -> dict[str, int]:
    out = {"reused": 0, "prefilled": 0, "generated": 0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "modeld_prefix_cache_hits_total":
                out["reused"] += int(s.value)
            elif s.name == "modeld_prompt_tokens_prefilled_total":
                out["prefilled"] += int(s.value)
            elif s.name == "modeld_generation_tokens_total":
                out["generated"] += int(s.value)
    return out


def _agent(url: str) -> list[dict[str, Any]]:
    """The demo's four turns over the OpenAI API: cold, warm, an edit inside the prefix, warm (the
    agent names its conversation, as agents send their session: the edit changes the system
    prompt, by which an unnamed conversation would be known)."""
    client = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=120,
        default_headers={"X-Modeld-Job": JOB, "X-Modeld-Conversation": "repo-session-1"},
    )
    edited = SYSTEM.replace("default_data_dir", "default_data_dir, socket_dir", 1)
    turns = [
        (SYSTEM, "Why does test_lease fail?"),
        (SYSTEM, "Add a retry."),
        (edited, "Update the callers."),
        (edited, "Write the changelog."),
    ]
    history: list[dict[str, Any]] = []
    out = []
    for system, question in turns:
        messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
        answer = client.chat.completions.create(model="modeld-reply", messages=messages, max_tokens=16)  # type: ignore[arg-type]
        body = answer.model_dump()
        out.append(body["modeld"])
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer.choices[0].message.content},
        ]
    return out


def test_the_page_shows_the_agents_turns_live_and_its_numbers_equal_metrics(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tiny = str(testmodels.ensure_model(testmodels.TINY))
    data = tmp_path / "d"
    # One slot per model: a second turn on a busy model waits, and the page says so.
    proc, record = serve_http(data, "--api-key", KEY, "--slots", "1", backend="llama")
    url = record.http_endpoint
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with _browser() as pw:
            # A fresh profile of its own (Playwright's persistent context is --user-data-dir).
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=CHROMIUM,
                args=FLAGS,
                headless=True,
                viewport={"width": 1360, "height": 1000},
            )
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/ui?token={KEY}")
            assert page.url == f"{url}/ui"  # the key left the address for an HttpOnly cookie
            page.wait_for_selector("#live.on", timeout=30_000)

            reuse = _agent(url)
            assert [r["reuse"] for r in reuse] == ["cold", "warm", "partial", "warm"]
            with rc.connect(data_dir=data, job="grpc-tool") as client:
                session = client.open_session(
                    OpenSessionRequest(
                        type="llama", path=tiny, model_name="grpc-tiny", config=Config(num_ctx=WINDOW)
                    )
                )
                for suffix in ("first\n", "second\n"):
                    session.ensure_prefix(PrefixInput(text=SYSTEM))
                    session.prefill_suffix(SuffixInput(text=suffix))
                    with session.decode(DecodeConfig(max_tokens=8)) as stream:
                        list(stream)

                # A long decode (random weights never end a turn): the page shows it running.
                seen_waiting = threading.Event()

                # Its end of turn is forbidden (a random model may sample it early) and it decodes a
                # token a step (speculation would draft the random model's loops, hundreds of tokens
                # a second): it runs until it is cancelled, so the other session's turn surely waits.
                ends = {t.id: -100.0 for t in session.info.special_tokens if t.kind in ("eos", "eot")}

                def long_turn() -> None:
                    session.ensure_prefix(PrefixInput(text=SYSTEM))
                    session.prefill_suffix(SuffixInput(text="a long one\n"))
                    with session.decode(
                        DecodeConfig(max_tokens=WINDOW - 1024, logit_bias=ends, speculation="off")
                    ) as stream:
                        for _ in stream:
                            if seen_waiting.is_set():
                                break  # leaving the block cancels the decode

                # The short turns' records are done first, so what runs next is the long turn.
                page.wait_for_function(
                    "() => !document.querySelector('#inflight-body [data-running]')",
                    polling=250,
                    timeout=30_000,
                )
                runner = threading.Thread(target=long_turn)
                runner.start()
                page.wait_for_selector("#inflight-body [data-running]", timeout=60_000)
                # Its stage moves on the page as it goes: the decode shows while it runs.
                page.wait_for_function(
                    "() => document.querySelector('#inflight-body').textContent.includes('decode')",
                    polling=250,
                    timeout=60_000,
                )
                # Another session's turn on the same model waits for its one slot: the page shows
                # it waiting, with its place in the queue.
                other = client.open_session(
                    OpenSessionRequest(
                        type="llama", path=tiny, model_name="grpc-tiny", config=Config(num_ctx=WINDOW)
                    )
                )
                waiter = threading.Thread(
                    target=lambda: other.ensure_prefix(PrefixInput(text=SYSTEM + "x\n"))
                )
                waiter.start()
                page.wait_for_function(
                    "() => document.querySelector('#inflight-body').textContent.includes('waiting for a slot (#1')",
                    polling=250,
                    timeout=60_000,
                )
                seen_waiting.set()
                runner.join(120)
                waiter.join(120)
                session.close()
                other.close()

            # Settled: the page's numbers are /metrics' numbers.
            page.wait_for_function(
                "() => !document.querySelector('#inflight-body [data-running]')", polling=250, timeout=30_000
            )
            time.sleep(2.5)  # the next push (at least every 2 s) carries the final counts
            metrics = _metric_totals(httpx.get(f"{url}/metrics", headers=auth, timeout=30).text)
            rows = page.eval_on_selector_all(
                "#conv-body tr",
                """rows => rows.map(r => ({key: r.dataset.key,
                    reused: +r.querySelector('[data-field=reused]').textContent.replace(/,/g, ''),
                    prefilled: +r.querySelector('[data-field=prefilled]').textContent.replace(/,/g, ''),
                    generated: +r.querySelector('[data-field=generated]').textContent.replace(/,/g, '')}))""",
            )
            assert {k: sum(r[k] for r in rows) for k in ("reused", "prefilled", "generated")} == metrics
            assert metrics["reused"] > 0 and metrics["generated"] >= 4 * 1 + 2 * 8

            # The agent's conversation: four bars, the edit says where it diverged.
            agent_row = page.locator("#conv-body tr", has_text=JOB)
            assert agent_row.count() == 1
            agent_row.click()
            turns = page.locator("#turns-body .turn")
            assert turns.count() == 4
            assert "computed ahead of the next turn" in turns.nth(0).inner_text()
            outcomes = [turns.nth(i).locator(".head span").first.inner_text() for i in range(4)]
            assert outcomes == ["cold", "warm", "partial", "warm"]
            why = turns.nth(2).locator(".why").inner_text()
            assert "diverged" in why and "segment 'system'" in why and "message 0" in why
            assert turns.nth(1).locator("[data-part=reused_kv]").count() == 1
            assert turns.nth(0).locator("[data-part=reused_kv]").count() == 0

            # Sorting and filtering.
            page.click("#conv-table th[data-sort=turns]")
            counts = page.eval_on_selector_all(
                "#conv-body tr td:nth-child(8)", "c => c.map(x => parseInt(x.textContent))"
            )
            assert counts == sorted(counts, reverse=True)
            page.fill("#filter", "grpc-tool")
            assert page.locator("#conv-body tr").count() == 2  # the two gRPC sessions
            page.fill("#filter", "")

            # Any past request by its job label.
            page.fill("#job", JOB)
            page.click("#search button")
            page.wait_for_selector("#requests-body tr[data-record]")
            # Its four turns, and the prefill ahead each answer left (finish "ahead": no turn bar).
            finishes = page.eval_on_selector_all(
                "#requests-body tr[data-record]", "rows => rows.map(r => r.children[7].textContent)"
            )
            assert sorted(finishes) == ["ahead"] * 4 + ["stop"] * 4, finishes

            assert errors == []
            text = page.inner_text("body")
            for broken in ("[object", "undefined", "NaN"):  # a value the script failed to draw
                assert broken not in text, broken
            page.click("#conv-body tr[data-key]:has-text('browser-agent')")
            shot = tmp_path / "live-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            wanted = os.environ.get("MODELD_SCREENSHOT")
            if wanted:
                shutil.copyfile(shot, wanted)
            request.node.user_properties.append(("screenshot", str(shot)))
            browser.close()
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]
