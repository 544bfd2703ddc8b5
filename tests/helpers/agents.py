"""Run the real coding agents (Claude Code, Codex CLI) headless in tests.

Test support, not product code. ``ensure_agents`` installs the pinned npm packages through
scripts/install_agents.sh (cached; a test skips, with the script's reason, only when the npm
registry is unreachable). ``make_repo`` makes a throwaway git repository to work in.
``run_claude`` and ``run_codex`` run one headless turn against a base URL with a throwaway home
and configuration that keeps each agent off the internet (no telemetry, no update checks), under
a hard timeout that kills the agent's whole process group.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "install_agents.sh"
REGISTRY_UNREACHABLE = 3  # install_agents.sh's exit code when npm cannot reach its registry
INSTALL_TIMEOUT = 900.0


class AgentsInstallError(RuntimeError):
    """The agents could not be installed for a reason other than an unreachable registry."""


@dataclass(frozen=True)
class Agents:
    claude: Path
    codex: Path


@functools.cache
def _install() -> Agents | str:
    proc = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode == REGISTRY_UNREACHABLE:
        lines = proc.stderr.strip().splitlines()
        return lines[-1] if lines else "install_agents.sh: the npm registry is unreachable"
    if proc.returncode != 0:
        raise AgentsInstallError(f"install_agents.sh failed ({proc.returncode}):\n{proc.stderr}")
    paths = parse_install_output(proc.stdout)
    return Agents(claude=paths["claude"], codex=paths["codex"])


def parse_install_output(stdout: str) -> dict[str, Path]:
    """``name=path`` lines -> {name: path}; every other line is an error."""
    paths: dict[str, Path] = {}
    for line in stdout.splitlines():
        name, sep, path = line.partition("=")
        if not sep or not name or not path:
            raise AgentsInstallError(f"install_agents.sh printed an unexpected line: {line!r}")
        paths[name] = Path(path)
    missing = {"claude", "codex"} - paths.keys()
    if missing:
        raise AgentsInstallError(f"install_agents.sh printed no path for {sorted(missing)}")
    return paths


def ensure_agents() -> Agents:
    """The installed agents' binaries; ``pytest.skip`` when the npm registry is unreachable."""
    got = _install()
    if isinstance(got, str):
        pytest.skip(got)
    return got


# --- a repository to work in ----------------------------------------------------------------

REPO_FILES = {
    "README.md": "# calc\n\nA tiny calculator used to try coding agents.\n",
    "calc.py": (
        '"""A tiny calculator."""\n\n\n'
        "def add(a: int, b: int) -> int:\n    return a + b\n\n\n"
        "def mul(a: int, b: int) -> int:\n    return a * b\n"
    ),
    "test_calc.py": (
        "from calc import add, mul\n\n\n"
        "def test_add() -> None:\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul() -> None:\n    assert mul(2, 3) == 6\n"
    ),
}

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "modeld tests",
    "GIT_AUTHOR_EMAIL": "tests@modeld.invalid",
    "GIT_COMMITTER_NAME": "modeld tests",
    "GIT_COMMITTER_EMAIL": "tests@modeld.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def make_repo(path: Path, files: Mapping[str, str] = REPO_FILES) -> Path:
    """A git repository at ``path`` with ``files`` committed (same commit id every time)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **_GIT_ENV}
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "commit.gpgsign=false", "commit", "-q", "-m", "initial"],
    ):
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True, timeout=30)
    return path


# --- running an agent -----------------------------------------------------------------------


@dataclass
class AgentRun:
    argv: list[str]
    returncode: int  # -9 when the timeout killed it
    stdout: str
    stderr: str
    result: Any  # Claude Code: the --output-format json object; Codex: its --json events; or None
    elapsed: float
    timed_out: bool


def _run(
    argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> tuple[int, str, str, float, bool]:
    """Run in a new process group; on timeout (and after exit) kill the whole group."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, err = proc.communicate()
    finally:
        _kill_group(proc.pid)  # whatever the agent left running in its group
    return proc.returncode, out, err, time.monotonic() - start, timed_out


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _base_env(home: Path, proxy: str | None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **{k: v for k, v in _GIT_ENV.items() if k.startswith("GIT_CONFIG")},
    }
    if proxy:
        # Any attempt to reach the internet then shows up in the proxy's log instead of failing
        # silently on DNS.
        env.update(HTTP_PROXY=proxy, HTTPS_PROXY=proxy, http_proxy=proxy, https_proxy=proxy)
    return env


def claude_env(
    home: Path,
    base_url: str,
    model: str,
    *,
    small_model: str | None = None,
    max_output_tokens: int = 1024,
    token: str = "modeld-test",
    max_retries: int | None = None,
    proxy: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a headless Claude Code run against ``base_url`` (no login needed).

    ``max_retries`` sets CLAUDE_CODE_MAX_RETRIES (Claude Code 2.1.328 retries a 429/5xx ten
    times by default, backing off to about 40 s: about 3 minutes before it gives up). ``extra``
    adds or overrides variables (e.g. CLAUDE_CODE_ATTRIBUTION_HEADER=0 drops the first system
    block, whose text changes with the first prompt)."""
    small = small_model or model
    home.mkdir(parents=True, exist_ok=True)
    retries = {"CLAUDE_CODE_MAX_RETRIES": str(max_retries)} if max_retries is not None else {}
    return {
        **retries,
        **_base_env(home, proxy),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": token,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": small,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": small,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        **(extra or {}),
    }


def run_claude(
    binary: Path,
    prompt: str,
    *,
    cwd: Path,
    home: Path,
    base_url: str,
    model: str,
    args: Sequence[str] = (),
    timeout: float = 180.0,
    **env_options: Any,
) -> AgentRun:
    """``claude -p PROMPT --output-format json [args]``; ``result`` is the parsed JSON."""
    env = claude_env(home, base_url, model, **env_options)
    argv = [str(binary), "-p", prompt, "--output-format", "json", *args]
    code, out, err, elapsed, timed_out = _run(argv, cwd=cwd, env=env, timeout=timeout)
    result: Any = None
    with contextlib.suppress(ValueError):
        result = json.loads(out)
    return AgentRun(argv, code, out, err, result, elapsed, timed_out)


def write_codex_config(
    codex_home: Path,
    base_url: str,
    model: str,
    *,
    context_window: int | None = 32768,
    request_max_retries: int | None = 0,
    stream_max_retries: int | None = 0,
    provider_extra: str = "",
    extra: str = "",
) -> Path:
    """A ``config.toml`` naming one keyless Responses provider at ``base_url``.

    It switches off what would reach the internet: update checks, analytics, feedback, web
    search, and plugins (Codex 0.169.0 contacts github.com, api.github.com and chatgpt.com for
    its plugin marketplace unless ``features.plugins`` is off). Retries default to none, and
    ``features.unbounded_connection_retries`` is off, so a server that is down fails the run at
    once instead of "Reconnecting... waiting for network" until the timeout; ``None`` leaves a
    setting at Codex's default. Codex 0.169.0 has no setting that caps output tokens (it sends no
    ``max_output_tokens``): the server's limit applies. ``provider_extra`` and ``extra`` are
    TOML lines added to the provider table and to the top level."""
    codex_home.mkdir(parents=True, exist_ok=True)
    optional = {
        "request_max_retries": request_max_retries,
        "stream_max_retries": stream_max_retries,
    }
    provider_lines = "".join(f"{k} = {v}\n" for k, v in optional.items() if v is not None)
    window = f"model_context_window = {context_window}\n" if context_window is not None else ""
    text = f"""\
model = {json.dumps(model)}
model_provider = "modeld"
{window}check_for_update_on_startup = false
web_search = "disabled"
approval_policy = "never"
sandbox_mode = "read-only"
{extra}
[model_providers.modeld]
name = "modeld"
base_url = {json.dumps(base_url)}
wire_api = "responses"
{provider_lines}{provider_extra}
[features]
plugins = false
unbounded_connection_retries = false

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"
"""
    path = codex_home / "config.toml"
    path.write_text(text)
    return path


def run_codex(
    binary: Path,
    prompt: str,
    *,
    cwd: Path,
    codex_home: Path,
    home: Path,
    args: Sequence[str] = (),
    subcommand: Sequence[str] = (),
    timeout: float = 180.0,
    proxy: str | None = None,
    env: Mapping[str, str] | None = None,
) -> AgentRun:
    """``codex exec [subcommand] --json --skip-git-repo-check [args] PROMPT`` with
    ``CODEX_HOME=codex_home`` (write its config with ``write_codex_config``); ``result`` is the
    list of JSON events it printed."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**_base_env(home, proxy), "CODEX_HOME": str(codex_home), **(env or {})}
    argv = [
        str(binary),
        "exec",
        *subcommand,
        "--json",
        "--skip-git-repo-check",
        "--strict-config",
        *args,
        prompt,
    ]
    code, out, err, elapsed, timed_out = _run(argv, cwd=cwd, env=env, timeout=timeout)
    events: list[Any] = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return AgentRun(argv, code, out, err, events or None, elapsed, timed_out)


# --- counting what an agent sends -----------------------------------------------------------


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (``host:port``) that counts the bytes each
    client sends upstream: what an agent puts on the wire, whatever its transport (HTTP requests,
    a WebSocket's frames). ``sent`` is the running total; read it between runs."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.sent = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        accept = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        accept.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self.connections += 1
            for src, dst, counted in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pipe, args=(src, dst, counted), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: Any, dst: Any, counted: bool) -> None:
        """Copy ``src`` to ``dst`` until either end closes; ``src`` is this pipe's to close (each
        socket is the source of exactly one of its connection's two pipes)."""
        try:
            while data := src.recv(65536):
                if counted:
                    with self._lock:
                        self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)
            src.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for t in self._threads:
            t.join(timeout=10)
