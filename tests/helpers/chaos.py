"""Chaos under load (issue 21 item 6): real clients on a real daemon while faults hit it.

Three clients run bounded turns on the tiny model: two agents (``runtime_client`` sessions
driven by the tool loop, ``run_tools``: a forced ``read_file`` call, its result, an answer) and
one conversation through the official OpenAI SDK over HTTP. Meanwhile a controller, at random
times drawn from a fixed seed, injects real faults with real signals:

* ``worker_kill``: SIGKILL of a random model's engine worker;
* ``worker_stop``: SIGSTOP of a worker past the stall timeout (the supervisor must kill it);
* ``daemon_kill``: SIGKILL of the daemon, then ``modeld serve`` started again;
* ``model_rewrite``: the model file overwritten in place with a same-size file whose K/V
  weights differ (TINY with the attention K/V of TINY at another seed);
* ``snapshot_corrupt``: a byte flipped inside one disk-tier snapshot's payload, just before the
  daemon is killed (its successor restores the agents' prefixes from the disk).

What must hold (``run`` raises ``AssertionError`` naming every violation):

* every turn completes, or fails with a typed, retryable error (``engine_restarted``,
  ``stall_timeout``, ``model_changed``, ``unavailable``, ``shutting_down``; over HTTP a 503 with
  one of those codes, or a refused connection while the daemon is down); the client then runs
  it again (``model_changed``: on a new session, as the error says);
* every completed greedy turn equals a fresh evaluation of the model file in force: each
  distinct (file version, request) is evaluated again at the end in a new in-process engine
  (split KV, no tiers, nothing warm from the run) and compared text for text, tool call for
  tool call. An agent's session names the model it ran on (its manifest's digest): that file
  version must have been in force during the turn; an HTTP turn that spanned the rewrite may
  equal either version, never a mix. A turn whose prompt holds earlier generated output (a
  tool loop's second round, a conversation's second question) may instead equal the
  uninterrupted replay of its task: llama.cpp evaluates a generated token alone and a prompt
  in batches, so that output's KV as decoded differs in the last bits from the same tokens
  prefilled (blueprint 0009), and a fault decides which of the two the turn reused;
* no orphan processes (no daemon and no worker of any daemon started here outlives the run), no
  file left half-written in the data directory (no temporary file; every snapshot file still
  there verifies, but one corrupted on purpose that no turn tried), and the last daemon's file
  descriptors and memory flat over a final stretch of turns;

and it prints the tally: faults injected, turns run, retried, and restored from each tier.

The daemon runs with split KV (``--no-kv-unified``): warm output is then bit-identical to a fresh
evaluation by construction (blueprint 0016), so any difference is a fault the run caused.

``tests/workers/test_chaos.py`` runs it for about a minute in CI; ``make chaos`` runs
``python tests/helpers/chaos.py --seconds 1800`` (30 minutes, faults every 10-40 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # daemon_proc, gguf_craft as a script

from daemon_proc import MODELD, wait_serving

import runtime_client as rc
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, StreamChunk
from modeld.errors import error_from_reason

MODEL_NAME = "chaos-tiny"
NUM_CTX = 2048
STALL_SECONDS = 4.0
FAULTS = ("worker_kill", "worker_stop", "daemon_kill", "model_rewrite", "snapshot_corrupt")
RETRYABLE = frozenset({"engine_restarted", "stall_timeout", "model_changed", "unavailable", "shutting_down"})
"""Typed errors a turn may end with under these faults (the client runs it again)."""
NEW_SESSION = frozenset({"model_changed", "session_closed"})
"""Of those, the ones after which the session has ended (the turn runs on a new one)."""

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file of the repository.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 12}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ]
)
SYSTEM = (
    "You are a coding agent in the repository of a small web service.\n"
    "src/app.py main() load_config() serve()\nsrc/db.py connect() migrate()\n"
    "tests/test_app.py test_main() test_migrate()\nRead files before you answer.\n"
)
QUESTIONS = (
    "Why does main() crash?",
    "Why does migrate() hang on an empty database?",
    "What does load_config() read first?",
    "Is serve() safe to call twice?",
)
CHAT_QUESTIONS = (
    "What is a warm prefix?",
    "Why does a restart cost a restore?",
    "Name one thing a KV cache holds.",
    "What breaks when a model file changes?",
)
FIRST = DecodeConfig(max_tokens=48, tool_choice="read_file")
LATER = DecodeConfig(max_tokens=8, tool_choice="none")


def agent_request(path: Path) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=str(path), config=Config(num_ctx=NUM_CTX, num_batch=64, prompt_format="chat")
    )


def read_file(call: rc.ToolCall) -> str:
    path = json.loads(call.arguments).get("path", "?")
    return f"{path}:\n1 def main():\n2     return load_config()['port'] / 0\n"


# --- the model file and its versions ---------------------------------------------------------


class Versions:
    """The model file the daemon serves, its two versions, and which one is in force."""

    def __init__(self, path: Path, versions: tuple[bytes, bytes]) -> None:
        self.path = path
        self.data = versions
        self.current = 0
        self.lock = threading.Lock()
        path.write_bytes(versions[0])

    def now(self) -> int:
        with self.lock:
            return self.current

    def rewrite(self) -> int:
        """Overwrite the file in place (same inode, same size) with the other version."""
        with self.lock:
            other = 1 - self.current
            with self.path.open("r+b") as f:
                f.write(self.data[other])
            self.current = other
            return other


def model_versions() -> tuple[bytes, bytes]:
    from gguf_craft import with_kv_of

    from modeld import testmodels

    tiny = testmodels.ensure_model(testmodels.TINY)
    donor = testmodels.ensure_model(replace(testmodels.TINY, seed=1))
    return tiny.read_bytes(), with_kv_of(tiny, donor)


# --- the daemon ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """``modeld serve`` with gRPC on a unix socket and HTTP on a fixed port, restartable."""

    def __init__(self, data: Path, model: Path) -> None:
        self.data, self.model = data, model
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every daemon started, for the orphan check
        self.lock = threading.Lock()
        self.log = (data.parent / "daemon.log").open("ab")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            MODELD,
            "--data-dir",
            str(self.data),
            "serve",
            "--backend",
            "llama",
            "--listen",
            f"unix:{self.data / 'd.sock'}",
            "--http",
            f"127.0.0.1:{self.port}",
            "--model",
            f"{MODEL_NAME}={self.model}",
            "--num-ctx",
            str(NUM_CTX),
            "--no-kv-unified",
            "--sequences",
            "3",
            "--persist-min-tokens",
            "128",  # the agents' prefixes go to disk at once; the short chat ones when it stops
            "--stall-timeout",
            f"{STALL_SECONDS:g}",
            "--restart-backoff",
            "0.2",
            "--crash-limit",
            "1000",
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)
        with self.lock:
            self.proc = proc
            self.pids.append(proc.pid)
        wait_serving(self.data, proc.pid, timeout=120)

    def kill(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> int:
        """An orderly stop (SIGTERM); its exit code."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return 0
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return -9

    @property
    def pid(self) -> int | None:
        with self.lock:
            return self.proc.pid if self.proc is not None else None

    def worker_pids(self) -> list[int]:
        pid = self.pid
        return [p for p in _workers() if _parent_arg(p) == pid] if pid else []


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _workers() -> list[int]:
    """Every engine worker process on the machine (``python -m modeld.workers.child``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and "modeld.workers.child" in _cmdline(int(entry)):
            out.append(int(entry))
    return out


def _parent_arg(pid: int) -> int | None:
    args = _cmdline(pid)
    with contextlib.suppress(ValueError, IndexError):
        return int(args[args.index("--parent") + 1])
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# --- the tally -----------------------------------------------------------------------------


@dataclass
class Turn:
    """A completed turn, for the fresh evaluation: what was asked, under which file version.

    ``steps`` are the requests of its task or conversation so far, this turn's last (agent:
    ``(prefix input, suffix input, DecodeConfig)`` per round; http: the JSON body per request).
    A first turn's prompt holds no generated text; a later one holds the earlier turns' output."""

    kind: str  # agent or http
    versions: tuple[int, int]  # in force when it started and when it ended
    steps: tuple[Any, ...]
    text: str
    finish: str
    calls: tuple[tuple[str, str], ...] = ()


@dataclass
class Tally:
    faults: Counter[str] = field(default_factory=Counter)
    turns: int = 0  # turns run (an attempt that was retried counts once more)
    completed: int = 0
    retried: Counter[str] = field(default_factory=Counter)  # why a turn ran again
    failed: Counter[str] = field(default_factory=Counter)  # untyped or unexpected: violations
    restored: Counter[str] = field(default_factory=Counter)  # how completed turns' prefixes came back
    resumes: int = 0
    records: list[Turn] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    corrupted: set[Path] = field(default_factory=set)  # snapshot files corrupted on purpose
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **changes: Any) -> None:
        with self.lock:
            for name, value in changes.items():
                current = getattr(self, name)
                if isinstance(current, Counter):
                    current[value] += 1
                elif isinstance(current, list):
                    current.append(value)
                else:
                    setattr(self, name, current + value)

    def where(self, reason: str, outcome: str, tier: str) -> str:
        if reason == "snapshot_rejected":
            return "rejected"
        if reason in ("restored_from_ram", "restored_from_disk"):
            return reason.rsplit("_", 1)[1]
        if outcome != "cold" and tier in ("ram", "disk"):
            return tier
        return "kv" if outcome != "cold" else "cold"

    def render(self, seconds: float, seed: int, first: int, later: int, distinct: int) -> str:
        faults = " · ".join(f"{k} {self.faults[k]}" for k in FAULTS)
        retried = ", ".join(f"{k} {v}" for k, v in sorted(self.retried.items())) or "none"
        restored = " · ".join(f"{k} {self.restored[k]}" for k in ("kv", "ram", "disk"))
        cold = f"cold {self.restored['cold']} · a snapshot rejected {self.restored['rejected']}"
        lines = [
            f"chaos: seed {seed}, {seconds:.0f} s, model {MODEL_NAME} (TINY), split KV",
            f"  faults    {faults}",
            f"  turns     run {self.turns} · completed {self.completed} · retried "
            f"{sum(self.retried.values())} ({retried}) · sessions resumed {self.resumes}",
            f"  prefixes  reused from {restored} · {cold} (turns and resumes' replays)",
            f"  checked   {first} first turns equal a fresh evaluation of the file in force; {later} later "
            "turns equal it or the uninterrupted replay of their task or conversation "
            f"({distinct} reference evaluations)",
        ]
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        return "\n".join(lines)


# --- the clients ---------------------------------------------------------------------------


class Observed:
    """A client session whose every ``ensure_prefix`` is tallied by how its prefix came back
    (also in a turn that fails later); otherwise the session itself."""

    def __init__(self, session: rc.ClientSession, tally: Tally) -> None:
        self.session, self.tally = session, tally

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def ensure_prefix(self, prefix: Any, progress: Any = None) -> Any:
        status = self.session.ensure_prefix(prefix, progress)
        reuse = status.reuse
        self.tally.add(restored=self.tally.where(reuse.reason, reuse.outcome, reuse.tier))
        return status


def agent(
    name: str, rng: random.Random, daemon: Daemon, versions: Versions, tally: Tally, until: Callable[[], bool]
) -> None:
    """Tool-loop tasks on one session, a new session when the old one ended."""
    client = rc.connect(data_dir=daemon.data, resume_timeout=120)
    session = client.open_session(agent_request(versions.path))
    resumes_seen = 0

    def count_resumes() -> None:  # each resume's replayed prefix, and how it came back
        nonlocal resumes_seen
        for resumed in session.resumes[resumes_seen:]:
            tally.add(resumes=1)
            if resumed.prefix is not None:
                reuse = resumed.prefix.reuse
                tally.add(restored=tally.where(reuse.reason, reuse.outcome, reuse.tier))
        resumes_seen = len(session.resumes)

    try:
        while not until():
            question = rng.choice(QUESTIONS)
            for _attempt in range(6):
                builder = (
                    rc.ContextBuilder(identity=session.identity, tools_json=TOOLS)
                    .system(SYSTEM)
                    .user_turn(question)
                )
                started = versions.now()
                try:
                    result = rc.run_tools(
                        Observed(session, tally),  # type: ignore[arg-type]
                        builder,
                        read_file,
                        FIRST,
                        after_first=LATER,
                        max_tool_iterations=1,
                    )
                    last = result.rounds[-1]
                    if last.finish_reason == "error":  # lost again after the loop's own retry
                        error = last.error
                        assert error is not None
                        raise error_from_reason(error.reason, error.message, {})
                except rc.ModeldError as exc:
                    tally.add(turns=1)  # the round that was lost
                    if exc.reason not in RETRYABLE:
                        tally.add(violations=f"{name}: turn failed with {exc.reason}: {exc.message[:300]}")
                        raise
                    tally.add(retried=exc.reason)
                    if exc.reason in NEW_SESSION:
                        count_resumes()
                        with contextlib.suppress(rc.ModeldError):
                            session.close()
                        session, resumes_seen = client.open_session(agent_request(versions.path)), 0
                    continue
                ended = versions.now()
                steps: list[Any] = []
                tally.add(turns=len(result.rounds))
                for i, r in enumerate(result.rounds):
                    if r.retry_reason:
                        tally.add(turns=1, retried=r.retry_reason)
                    assert r.context is not None
                    steps.append(
                        (r.context.prefix_input(), r.context.suffix_input(), FIRST if i == 0 else LATER)
                    )
                    calls = tuple((c.name, c.arguments) for c in r.calls)
                    turn = Turn("agent", (started, ended), tuple(steps), r.text, r.finish_reason, calls)
                    tally.add(completed=1, records=turn)
                break
            else:
                tally.add(violations=f"{name}: a turn failed six times in a row")
            count_resumes()
    finally:
        with contextlib.suppress(rc.ModeldError):
            session.close()
        client.close()


def conversation(
    rng: random.Random, daemon: Daemon, versions: Versions, tally: Tally, until: Callable[[], bool]
) -> None:
    """An OpenAI SDK chat: each answer and a new question appended, restarted every 6 turns."""
    import openai

    sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages: list[dict[str, str]] = []
    steps: list[dict[str, Any]] = []
    try:
        while not until():
            if len(steps) >= 2 or not messages:  # a conversation: a question, its answer, another
                messages, steps = [{"role": "system", "content": "Answer in one short sentence."}], []
            messages.append({"role": "user", "content": rng.choice(CHAT_QUESTIONS)})
            body = {"model": MODEL_NAME, "messages": list(messages), "max_tokens": 10, "temperature": 0}
            steps.append(body)
            for _attempt in range(200):
                started = versions.now()
                tally.add(turns=1)
                try:
                    raw = sdk.chat.completions.with_raw_response.create(**body)  # type: ignore[arg-type]
                except openai.APIConnectionError:
                    # The daemon is down (killed, restarting): the port refuses. Retryable.
                    tally.add(retried="unavailable")
                    time.sleep(0.2)
                    continue
                except openai.APIStatusError as exc:
                    code = _error_code(exc)
                    if exc.status_code == 503 and code in RETRYABLE:
                        tally.add(retried=code)
                        time.sleep(0.1)
                        continue
                    tally.add(violations=f"http: {exc.status_code} {code}: {str(exc)[:300]}")
                    raise
                ended = versions.now()
                data = json.loads(raw.text)
                choice = data["choices"][0]
                ext = data.get("modeld", {})
                tally.add(
                    restored=tally.where(ext.get("reason", ""), ext.get("reuse", "cold"), ext.get("tier", ""))
                )
                text = choice["message"].get("content") or ""
                tally.add(
                    completed=1,
                    records=Turn("http", (started, ended), tuple(steps), text, choice["finish_reason"]),
                )
                messages.append({"role": "assistant", "content": text})
                break
            else:
                tally.add(violations="http: a turn failed 200 times in a row")
    finally:
        sdk.close()


def _error_code(exc: Any) -> str:
    try:
        return str(exc.response.json()["error"].get("code") or "")
    except Exception:
        return ""


# --- the faults ------------------------------------------------------------------------------


def schedule(rng: random.Random, seconds: float) -> list[tuple[float, str]]:
    """When each fault strikes: every kind once, spread over the run (at least 8 s apart), a
    snapshot corrupted just before the daemon is killed (the restarted daemon has no RAM tier:
    the agents' prefixes come back from the disk, the corrupted file among them); a long run adds
    one every 10-40 s after that (the model file rewritten every 10 minutes at most, a snapshot
    corrupted before each daemon kill)."""
    kinds = [k for k in FAULTS if k != "snapshot_corrupt"]
    rng.shuffle(kinds)
    span = max(8.0 * len(kinds), seconds * 0.7)
    slot = span / len(kinds)
    out: list[tuple[float, str]] = []
    for i, kind in enumerate(kinds):
        out.append((seconds * 0.1 + i * slot + rng.uniform(3.0, max(3.0, slot - 6.0)), kind))
    t = out[-1][0] + 15.0
    last_rewrite = next(at for at, k in out if k == "model_rewrite")
    while t < seconds - 20.0:
        kind = rng.choice([k for k in FAULTS if k != "snapshot_corrupt"])
        if kind == "model_rewrite" and t - last_rewrite < 600:
            kind = "worker_kill"
        if kind == "model_rewrite":
            last_rewrite = t
        out.append((t, kind))
        t += rng.uniform(10.0, 40.0)
    return sorted(out + [(at - 0.5, "snapshot_corrupt") for at, k in out if k == "daemon_kill"])


def controller(
    plan: list[tuple[float, str]],
    rng: random.Random,
    daemon: Daemon,
    versions: Versions,
    tally: Tally,
    start: float,
    stop: threading.Event,
) -> None:
    for at, kind in plan:
        if stop.wait(max(0.0, start + at - time.monotonic())):
            return
        try:
            done = inject(kind, rng, daemon, versions, tally)
        except Exception as exc:  # a fault the controller could not inject is reported, not hidden
            tally.add(violations=f"controller: {kind} failed: {exc!r}")
            continue
        if done:
            tally.add(faults=kind)


def inject(kind: str, rng: random.Random, daemon: Daemon, versions: Versions, tally: Tally) -> bool:
    if kind == "worker_kill":
        workers = daemon.worker_pids()
        if not workers:
            return False
        os.kill(rng.choice(workers), signal.SIGKILL)
        return True
    if kind == "worker_stop":
        workers = daemon.worker_pids()
        if not workers:
            return False
        pid = rng.choice(workers)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + STALL_SECONDS * 4 + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):  # no operation reached it: nothing stalled; let it go on
            tally.add(
                notes=f"worker {pid} stopped {STALL_SECONDS * 4 + 10:.0f} s with no operation for it; continued"
            )
            os.kill(pid, signal.SIGCONT)
        return True
    if kind == "daemon_kill":
        daemon.kill()
        time.sleep(rng.uniform(0.0, 1.5))
        daemon.start()
        return True
    if kind == "model_rewrite":
        versions.rewrite()
        return True
    if kind == "snapshot_corrupt":
        # The file a restarted daemon tries first for the agents' shared first prefix: every
        # agent snapshot starts with it, so among the newest file's model and runtime (the file
        # version in force), the first by name (the daemon indexes files in name order and a
        # snapshot must beat the first equal one by restore_min_gain tokens to replace it).
        files = sorted((daemon.data / "kv").glob("*.kvs")) if (daemon.data / "kv").is_dir() else []
        files = [f for f in files if f not in tally.corrupted]
        if not files:
            return False
        newest = max(files, key=lambda f: f.stat().st_mtime)
        path = min(f for f in files if f.name[:29] == newest.name[:29])
        with path.open("r+b") as f:
            size = f.seek(0, os.SEEK_END)
            at = size - rng.randrange(16, max(17, size // 4))  # inside the payload (the file's tail)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        tally.corrupted.add(path)
        return True
    raise AssertionError(kind)


# --- the fresh evaluation -----------------------------------------------------------------------


Answer = tuple[str, str, tuple[tuple[str, str], ...]]


class Fresh:
    """Reference evaluations in a new in-process engine on a copy of a version's bytes (split
    KV, no tiers, nothing from the run): :meth:`fresh` runs a turn's own request alone;
    :meth:`replay` runs its task's or conversation's requests in order on one engine, so the
    earlier turns' output is in the KV as their decodes produced it (llama.cpp evaluates a
    generated token alone, a prefill in batches: the numbers differ, blueprint 0009). A turn
    whose prompt holds earlier output equals one of the two: the fresh one when that output's KV
    was recomputed (a fault lost it), the replay when it was reused."""

    def __init__(self, versions: Versions, tmp: Path) -> None:
        self.versions = versions
        self.tmp = tmp
        self.memo: dict[str, Answer] = {}
        self._digests: dict[int, str] = {}

    def version_of(self, model_digest: str) -> int | None:
        """Which version of the file has this model digest (what a session's manifest names)."""
        for version in (0, 1):
            if version not in self._digests:
                with self._engine() as engine:
                    self._digests[version] = engine.describe(agent_request(self._file(version))).model_digest
            if self._digests[version] == model_digest:
                return version
        return None

    def fresh(self, turn: Turn, version: int) -> Answer:
        return self._memo(turn.kind, version, turn.steps[-1:])

    def replay(self, turn: Turn, version: int) -> Answer:
        return self._memo(turn.kind, version, turn.steps)

    def _memo(self, kind: str, version: int, steps: tuple[Any, ...]) -> Answer:
        key = repr((kind, version, steps))
        if key not in self.memo:
            self.memo[key] = self._agent(steps, version) if kind == "agent" else self._http(steps, version)
        return self.memo[key]

    def _file(self, version: int) -> Path:
        path = self.tmp / f"v{version}" / "m.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.versions.data[version])
        return path

    @contextlib.contextmanager
    def _engine(self) -> Iterator[Any]:
        from modeld.engine import Engine
        from modeld.settings import Residency

        residency = Residency(
            sequences=1, kv_unified=False, ram_tier_bytes=0, disk_tier_bytes=0, isolation="inline"
        )
        with Engine(backends=("llama",), residency=residency) as engine:
            yield engine

    def _agent(self, steps: tuple[Any, ...], version: int) -> Answer:
        with self._engine() as engine:
            session = engine.open_session(agent_request(self._file(version)))
            for prefix, suffix, config in steps:
                session.ensure_prefix(prefix)
                session.prefill_suffix(suffix)
                with session.decode(config) as stream:
                    chunks: list[StreamChunk] = list(stream)
        final = chunks[-1]
        calls = tuple((c.name, c.arguments) for c in final.tool_calls)
        return "".join(c.text for c in chunks), final.finish_reason or "error", calls

    def _http(self, steps: tuple[Any, ...], version: int) -> Answer:
        import asyncio

        import httpx

        from modeld.engine import Limits
        from modeld.server.gateway import Gateway
        from modeld.server.http.app import HttpService
        from modeld.server.http.models import ModelEntry, ModelRegistry
        from modeld.server.http.routes import build_app
        from modeld.settings import HttpSettings

        with self._engine() as engine:
            entry = ModelEntry(MODEL_NAME, str(self._file(version)), 0)
            service = HttpService(
                Gateway(engine, Limits()),
                ModelRegistry("llama", {MODEL_NAME: entry}),
                HttpSettings(num_ctx=NUM_CTX),
            )

            async def ask() -> httpx.Response:
                transport = httpx.ASGITransport(app=build_app(service))
                async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                    for body in steps:
                        r = await client.post("/v1/chat/completions", json=body, timeout=120)
                        assert r.status_code == 200, r.text
                return r

            try:
                r = asyncio.run(ask())
            finally:
                service.close()
        choice = r.json()["choices"][0]
        return choice["message"].get("content") or "", choice["finish_reason"], ()


def check_fresh(tally: Tally, versions: Versions, tmp: Path) -> tuple[int, int, int]:
    """Every completed turn against its references; (first turns, later turns, evaluations)."""
    fresh = Fresh(versions, tmp)
    first = later = 0
    for turn in tally.records:
        got = (turn.text, turn.finish, turn.calls)
        candidates = sorted(set(turn.versions))
        if turn.kind == "agent":  # the model its session ran on: it must have been in force
            manifest = turn.steps[-1][0].manifest
            ran = fresh.version_of(manifest.model_digest if manifest is not None else "")
            if ran not in candidates:
                tally.violations.append(
                    f"an agent turn ran on file version {ran}, not one in force then ({candidates})"
                )
                continue
            candidates = [ran]
        answers = [fresh.fresh(turn, v) for v in candidates]
        if len(turn.steps) > 1:
            answers += [fresh.replay(turn, v) for v in candidates]
            later += 1
        else:
            first += 1
        if got not in answers:
            tally.violations.append(
                f"{turn.kind} turn under file version(s) {candidates}: got {got!r}, the references give "
                f"{answers!r} (request {str(turn.steps[-1])[:300]})"
            )
    return first, later, len(fresh.memo)


# --- the end state ----------------------------------------------------------------------------


def steady(daemon: Daemon, versions: Versions, tally: Tally, turns: int) -> tuple[int, int]:
    """Turns with no fault, on one session: the daemon's and its workers' fds and RSS after."""
    client = rc.connect(data_dir=daemon.data)
    try:
        with client.open_session(agent_request(versions.path)) as session:
            for i in range(turns):
                builder = (
                    rc.ContextBuilder(identity=session.identity, tools_json=TOOLS)
                    .system(SYSTEM)
                    .user_turn(QUESTIONS[i % len(QUESTIONS)])
                )
                rc.run_tools(session, builder, read_file, FIRST, after_first=LATER, max_tool_iterations=1)
    finally:
        client.close()
    pids = [p for p in [daemon.pid, *daemon.worker_pids()] if p]
    return sum(_fds(p) for p in pids), sum(_rss(p) for p in pids)


def end_state(daemon: Daemon, versions: Versions, tally: Tally, fds_before: int) -> None:
    first = steady(daemon, versions, tally, 6)
    second = steady(daemon, versions, tally, 18)
    tally.notes.append(
        f"flat      daemon + workers after 6 and 24 quiet tool-loop turns: fds {first[0]} -> {second[0]}, "
        f"RSS {first[1] / 2**20:.1f} -> {second[1] / 2**20:.1f} MiB"
    )
    if second[0] > first[0] + 2:
        tally.violations.append(f"file descriptors grew over quiet turns: {first[0]} -> {second[0]}")
    if second[1] > first[1] + (16 << 20):
        tally.violations.append(f"memory grew over quiet turns: {first[1]} -> {second[1]} bytes")
    code = daemon.stop()
    if code != 0:
        tally.violations.append(f"the last daemon's orderly stop exited {code}")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        orphans = [p for p in _workers() if _parent_arg(p) in daemon.pids]
        orphans += [p for p in daemon.pids if _alive(p) and "serve" in _cmdline(p)]
        if not orphans:
            break
        time.sleep(0.2)
    tally.notes.append(f"processes {len(daemon.pids)} daemons started, orphans left {len(orphans)}")
    if orphans:
        tally.violations.append(f"orphan processes: {orphans} {[_cmdline(p) for p in orphans]}")
    half = [p.name for p in daemon.data.rglob("*") if p.name.endswith(".tmp")]
    bad, untried = [], False
    snapshots = 0
    from modeld.cache.snapfile import SnapshotError, open_verified, read_header

    for path in sorted((daemon.data / "kv").glob("*.kvs")) if (daemon.data / "kv").is_dir() else []:
        try:
            header, _ = read_header(path)
            with open_verified(path, header):
                snapshots += 1
        except (OSError, SnapshotError) as exc:
            if path in tally.corrupted:  # ours, never tried (a file of its name written since verifies)
                untried = True
            else:
                bad.append(f"{path.name}: {exc}")
    log = (daemon.data.parent / "daemon.log").read_text(errors="replace")
    refused = sum(1 for line in log.splitlines() if "removed KV snapshot" in line)
    tally.notes.append(
        f"files     {snapshots} snapshot files verify, temporary files left {len(half)}; the daemons "
        f"refused and removed {refused} snapshot file(s)"
        + ("; the corrupted one was never tried (still on disk)" if untried else "")
    )
    if half or bad:
        tally.violations.append(f"half-written or broken files: {half} {bad}")
    fds_after = _fds(os.getpid())
    tally.notes.append(f"client    this process's fds {fds_before} -> {fds_after}")
    if fds_after > fds_before + 4:
        tally.violations.append(f"the clients leaked file descriptors: {fds_before} -> {fds_after}")


# --- the run ---------------------------------------------------------------------------------


def run(seconds: float, seed: int, work: Path | None = None, quiet: bool = False) -> Tally:
    """The chaos run (see the module docstring); the tally (violations raise at the end)."""
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="chaos")) if work is None else work
    rng = random.Random(seed)
    tally = Tally()
    versions = Versions(work / "m.gguf", model_versions())
    daemon = Daemon(work / "data", versions.path)
    fds_before = _fds(os.getpid())
    started = time.monotonic()
    try:
        daemon.start()
        stop = threading.Event()
        start = time.monotonic()

        def until() -> bool:
            return stop.is_set() or time.monotonic() - start > seconds

        plan = schedule(random.Random(rng.random()), seconds)
        errors: list[BaseException] = []

        def client(target: Callable[..., None], *args: Any) -> threading.Thread:
            def body() -> None:
                try:
                    target(*args)
                except BaseException as exc:  # a client that ends early ends the run
                    errors.append(exc)
                    stop.set()

            return threading.Thread(target=body, name=target.__name__)

        threads = [
            client(agent, "agent-1", random.Random(rng.random()), daemon, versions, tally, until),
            client(agent, "agent-2", random.Random(rng.random()), daemon, versions, tally, until),
            client(conversation, random.Random(rng.random()), daemon, versions, tally, until),
        ]
        faults = threading.Thread(
            target=controller, args=(plan, random.Random(rng.random()), daemon, versions, tally, start, stop)
        )
        for t in threads:
            t.start()
        faults.start()
        for t in threads:
            t.join(timeout=seconds + 600)
        stop.set()
        faults.join(timeout=120)
        for exc in errors:
            tally.violations.append(f"a client ended: {exc!r}")
        if daemon.pid is None:
            daemon.start()
        end_state(daemon, versions, tally, fds_before)
        first, later, distinct = check_fresh(tally, versions, work / "fresh")
        missing = [k for k in FAULTS if not tally.faults[k]]
        if missing:
            tally.violations.append(f"faults never injected: {missing}")
        text = tally.render(time.monotonic() - started, seed, first, later, distinct)
        if not quiet:
            print(text, flush=True)
        tally.notes.append(text)
        if tally.violations:
            raise AssertionError(text)
        return tally
    finally:
        daemon.kill()
        daemon.log.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--seconds", type=float, default=1800.0, help="how long the clients run (default 1800)"
    )
    parser.add_argument("--seed", type=int, default=21, help="the faults' and clients' seed (default 21)")
    parser.add_argument(
        "--keep", metavar="DIR", help="work in DIR and keep it (the daemon's log is daemon.log)"
    )
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    try:
        run(args.seconds, args.seed, work)
    except AssertionError:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
