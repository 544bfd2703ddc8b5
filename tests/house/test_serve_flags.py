"""``modeld serve`` has a flag for every setting, sizes and durations are read the way people
write them, a bad value is one clear line (exit 2), and the values reach the engine: ``modeld
status`` shows them from a real daemon."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
from daemon_proc import modeld, serve_http, start_serve, stop, wait_serving

import runtime_client as rc
from modeld.cli import _parser
from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput
from modeld.flags import field_docs, flag_of, parse_duration, parse_size
from modeld.settings import SETTINGS

pytestmark = pytest.mark.wire


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("8G", 8 << 30),
        ("8GiB", 8 << 30),
        ("8GB", 8 << 30),
        ("1.5G", 3 << 29),
        ("64K", 64 << 10),
        ("2T", 2 << 40),
        ("0", 0),
        ("auto", -1),
        ("AUTO", -1),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["12Q", "-1", "", "M", "1..5G", "nan", "inf", "9" * 80, "1e30T"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("2.5m", 150.0),
        ("1h", 3600.0),
        ("0", 0.0),
        ("0.25", 0.25),
        ("50ms", 0.05),
        ("20MS", 0.02),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["-5", "5x", "", "s", "ms", "5mss", "inf", "nan", "1d"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def _serve_options() -> dict[str, argparse.Action]:
    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {o: a for a in serve._actions for o in a.option_strings}


def test_every_setting_has_exactly_one_flag_with_help_and_the_readme_names_it() -> None:
    """Adding a settings field adds its flag (``modeld/flags.py``): each field of every
    settings dataclass is one ``modeld serve`` option, documented by the field's docstring,
    unset by default, and listed in the README's command line block."""
    options = _serve_options()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Command line")
    block = readme[start : readme.index("modeld describe --type", start)]
    seen: dict[str, str] = {}
    for cls in SETTINGS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            name = flag_of(f).name
            assert name not in seen, f"{cls.__name__}.{f.name} and {seen[name]} share {name}"
            seen[name] = f"{cls.__name__}.{f.name}"
            action = options[name]
            assert action.dest == f"{cls.__name__.lower()}.{f.name}"
            assert action.default is None
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring (its --help)"
            assert (action.help or "").startswith(docs[f.name].replace("``", "")[:40])
            assert re.search(re.escape(name) + r"\b", block) or f"--[no-]{name[2:]}" in block, (
                f"README's modeld serve block does not name {name}"
            )
    settings_dests = {a.dest for a in options.values() if "." in a.dest}
    assert len(settings_dests) == len(seen) == sum(len(dataclasses.fields(c)) for c in SETTINGS)


def test_serve_help_is_the_settings_and_nothing_else() -> None:
    """``modeld serve --help`` and ``modeld/settings.py`` are the same list: every option of
    ``serve`` is a settings field's flag, but for help and the two global options every command
    takes (``--address``, ``--data-dir``)."""
    options = _serve_options()
    flags = {flag_of(f).name for cls in SETTINGS for f in dataclasses.fields(cls)}
    negations = {f"--no-{name[2:]}" for name in flags}
    assert set(options) - flags - negations == {"-h", "--help", "--address", "--data-dir"}


def test_an_unset_flag_keeps_the_default_and_a_set_one_reaches_its_field() -> None:
    from modeld.cli import serve_options
    from modeld.settings import Limits, Residency, RestartPolicy, Timeouts

    options = serve_options(_parser().parse_args(["serve"]))
    assert (options.limits, options.residency, options.timeouts, options.restart) == (
        Limits(),
        Residency(),
        Timeouts(),
        RestartPolicy(),
    )
    options = serve_options(
        _parser().parse_args(
            ["serve", "--max-segments", "12", "--closed-reports-kept", "0", "--no-kv-unified"]
        )
    )
    assert options.limits == Limits(max_segments=12, closed_reports_kept=0)
    assert options.residency == Residency(kv_unified=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ram-tier-bytes", "12Q"],
            "modeld serve: error: argument --ram-tier-bytes: invalid size '12Q': give bytes with an "
            "optional K, M, G or T suffix (512M, 8G), 0 for off, or auto (see modeld serve --help)",
        ),
        (
            ["--sequences", "0"],
            "modeld serve: error: argument --sequences: 0 is out of range (1 to 256) (see modeld serve --help)",
        ),
        (
            ["--stall-timeout", "soon"],
            "modeld serve: error: argument --stall-timeout: invalid duration 'soon': give seconds, or a "
            "number with ms, s, m or h (90, 2.5m, 1h, 50ms) (see modeld serve --help)",
        ),
        (
            ["--stream-interval", "11s"],
            "modeld serve: error: --stream-interval is at most 10s (a held token is that much late)",
        ),
        (
            ["--no-kv-unified", "--kv-pool-tokens", "4096"],
            "modeld serve: error: --kv-pool-tokens sizes the unified KV pool: drop --no-kv-unified",
        ),
        (
            ["--max-text-bytes", "16M"],
            "modeld serve: error: --max-message-bytes must exceed --max-text-bytes by at least 64 KiB "
            "(room for the manifest)",
        ),
        (
            ["--memory-budget", "0"],
            "modeld serve: error: --memory-budget 0 leaves no room for any model (use auto for the default)",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = modeld("serve", "--backend", "memory", *args, data_dir=Path(tempfile.mkdtemp(prefix="mdf")))
    assert out.returncode == 2
    assert out.stderr == message + "\n"


def test_a_bad_choice_is_one_line_and_exit_2() -> None:
    out = modeld("serve", "--isolation", "thread", data_dir=Path(tempfile.mkdtemp(prefix="mdf")))
    assert out.returncode == 2
    assert out.stderr.startswith("modeld serve: error: argument --isolation: invalid choice: 'thread'")
    assert out.stderr.endswith(" (see modeld serve --help)\n")
    assert out.stderr.count("\n") == 1


def test_every_setting_reaches_the_engine_and_status_shows_it() -> None:
    data = Path(tempfile.mkdtemp(prefix="mdf"))
    flags = [
        *("--sequences", "2", "--kv-unified", "--kv-pool-tokens", "3000", "--checkpoints", "3"),
        "--no-swa-full",
        *("--ram-tier-bytes", "64M", "--disk-tier-bytes", "0", "--memory-budget", "4G"),
        *("--isolation", "inline", "--slots", "1", "--max-queue", "3"),
        *("--snapshot-min-tokens", "32", "--persist-min-tokens", "256"),
        *("--load-timeout", "90", "--stall-timeout", "2m", "--idle-stream-timeout", "45s"),
        *("--operation-timeout", "1h", "--queue-wait", "12", "--attach-timeout", "9"),
        *("--stream-interval", "20ms", "--speculation", "off"),
        *("--restart-backoff", "0.25", "--restart-backoff-max", "4", "--crash-limit", "3"),
        *("--crash-window", "10m", "--describe-timeout", "20", "--max-sessions", "10"),
        *("--shared-store", str(data / "shared"), "--shared-store-bytes", "32M", "--drain-timeout", "15s"),
    ]
    proc = start_serve(data, data / "s.sock", *flags)
    try:
        wait_serving(data, proc.pid)
        with (
            rc.connect(data_dir=data) as client,
            client.open_session(OpenSessionRequest(type="memory", path="tiny", model_name="coder")) as s,
        ):
            s.ensure_prefix(PrefixInput(text="hello\n"))
            status = json.loads(modeld("status", "--json", data_dir=data).stdout)
            human = modeld("status", data_dir=data).stdout
        assert status["settings"] == {
            "sequences": "2",
            "kv_unified": "True",
            "checkpoints": "3",
            "swa_full": "False",
            "pool_tokens": "3000",
            "ram_tier_bytes": str(64 << 20),
            "disk_tier_bytes": "0",
            "memory_budget_bytes": str(4 << 30),
            "isolation": "inline",
            "slots": "1",
            "max_queue": "3",
            "snapshot_min_tokens": "32",
            "persist_min_tokens": "256",
            "shared_store": str(data / "shared"),
            "shared_store_bytes": str(32 << 20),
            "speculation": "off",
            "timeout_load_seconds": "90.0",
            "timeout_stall_seconds": "120.0",
            "timeout_idle_stream_seconds": "45.0",
            "timeout_operation_seconds": "3600.0",
            "timeout_drain_seconds": "15.0",
            "timeout_stream_interval_seconds": "0.02",
            "restart_backoff_initial": "0.25",
            "restart_backoff_max": "4.0",
            "restart_crash_limit": "3",
            "restart_crash_window": "600.0",
        }
        assert status["limits"]["model_wait_seconds"] == 12
        assert status["limits"]["attach_timeout_seconds"] == 9
        assert status["limits"]["max_sessions"] == 10
        tiers = status["tiers"]
        assert (tiers["ram_budget"], tiers["disk_budget"], tiers["memory_budget"]) == (64 << 20, 0, 4 << 30)
        (model,) = status["models"]
        assert (model["sequences"], model["pool_tokens"], model["slots"]) == (2, 3000, 1)
        assert model["worker"]["isolation"] == "inline"
        assert "ram_tier_bytes=64.00 MiB" in human
        assert "disk_tier_bytes=off" in human
        assert "memory_budget_bytes=4.00 GiB" in human
        assert "tiers     ram   0 snapshots, 0 B of 64.00 MiB" in human
        assert "          disk  off (budget 0)" in human
        assert f"          shared 0 snapshots, 0 B of 32.00 MiB in {data / 'shared'}" in human
        assert (tiers["shared_location"], tiers["shared_budget"]) == (str(data / "shared"), 32 << 20)
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def test_lowered_limits_are_enforced_with_their_reason() -> None:
    """Each operating limit lowered by its flag refuses what goes beyond it with
    ``limit_exceeded`` naming the limit: over HTTP (OpenAI's and Anthropic's shapes, before the
    turn runs, or at the decode for a constraint's size) and over gRPC (the engine's own check of
    a decode's tools)."""
    data = Path(tempfile.mkdtemp(prefix="mdf"))
    flags = ["--max-messages", "2", "--max-tools", "1", "--max-choices", "2", "--max-stop-strings", "1"]
    proc, record = serve_http(data, *flags, "--max-constraint-bytes", "1K")
    url = record.http_endpoint
    user = {"role": "user", "content": "hello"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    schema = {"type": "object", "description": "x" * 2000}
    try:
        within = {"model": "modeld-tiny", "messages": [user, user], "max_tokens": 2, "n": 2, "stop": ["z"]}
        assert httpx.post(f"{url}/v1/chat/completions", json=within, timeout=60).status_code == 200
        for extra, limit in [
            ({"messages": [user, user, user]}, "max_messages"),
            ({"tools": [tool, tool]}, "max_tools"),
            ({"n": 3}, "max_choices"),
            ({"stop": ["y", "z"]}, "max_stop_strings"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                "max_constraint_bytes",
            ),
        ]:
            answer = httpx.post(f"{url}/v1/chat/completions", json={**within, "n": 1, **extra}, timeout=60)
            error = answer.json()["error"]
            assert (answer.status_code, error["code"], error["param"]) == (400, "limit_exceeded", limit), (
                extra
            )
            assert f"--{limit.replace('_', '-')}" in error["message"]
        messages = {"model": "modeld-tiny", "max_tokens": 2, "messages": [user, user, user]}
        answer = httpx.post(f"{url}/v1/messages", json=messages, timeout=60)
        assert answer.status_code == 400 and "max-messages" in answer.json()["error"]["message"]
        with (
            rc.connect(data_dir=data) as client,
            client.open_session(OpenSessionRequest(type="memory", path="tiny")) as session,
        ):
            session.ensure_prefix(PrefixInput(text="hello\n"))
            with pytest.raises(rc.LimitExceededError) as exc:
                session.decode(DecodeConfig(max_tokens=2, tools_json=json.dumps([tool, tool])))
            assert exc.value.limit == "max_tools"
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def test_a_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = modeld(
            "serve",
            "--backend",
            "memory",
            "--listen",
            f"127.0.0.1:{port}",
            data_dir=Path(tempfile.mkdtemp(prefix="mdf")),
        )
    assert out.returncode == 1
    assert f"could not listen on 127.0.0.1:{port} (is it in use?)" in out.stderr
    assert "Traceback" not in out.stderr
