"""``pip install modeld`` with no extras serves the memory backend.

A first integrator's ``modeld serve --backend memory`` died with ``ModuleNotFoundError:
jinja2``. This builds the wheel from the working tree, installs it alone into a fresh virtual
environment (dependencies from the same package index ``make setup`` uses), and drives the
daemon with that environment's own ``runtime_client``: raw prompts work, a chat session fails
with a typed error naming the extra, ``modeld metrics`` works, ``--http`` names its extra.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from modeld.lease import read_lease

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

_CLIENT = textwrap.dedent(
    """
    import sys
    import runtime_client as rc
    with rc.connect(data_dir=sys.argv[1]) as client:
        with client.open_session(rc.OpenSessionRequest(type="memory", path="tiny")) as s:
            status = s.ensure_prefix(rc.PrefixInput(text="hello\\n"))
            chunks = list(s.decode(rc.DecodeConfig(max_tokens=3)))
            print(status.prefix_tokens, chunks[-1].usage.completion_tokens)
        chat = client.open_session(rc.OpenSessionRequest(type="memory", path="tiny",
                                                          config=rc.Config(prompt_format="chat")))
        try:
            chat.ensure_prefix(rc.PrefixInput(text="hello\\n"))
        except rc.UnsupportedError as exc:
            print(exc.reason, "modeld[http]" in exc.message, "jinja2" in exc.message)
        chat.close()
    """
)


def _run(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Outside the repository, so that `python -c` cannot import the working tree's packages.
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
    )


def test_the_base_package_alone_serves_the_memory_backend() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdi"))
    try:
        source = tmp / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, source / name)
        for package in ("modeld", "runtime_client"):
            shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
        built = _run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp / "dist",
            source,
        )
        assert built.returncode == 0, built.stderr[-3000:]
        wheel = next((tmp / "dist").glob("modeld-*.whl"))
        venv = tmp / "venv"
        assert _run(sys.executable, "-m", "venv", venv).returncode == 0
        python, bin_dir = venv / "bin" / "python", venv / "bin"
        installed = _run(python, "-m", "pip", "install", "--quiet", wheel)
        assert installed.returncode == 0, installed.stderr[-3000:]
        for absent in ("jinja2", "starlette", "uvicorn", "llama_cpp", "openvino_genai", "gguf"):
            probe = _run(
                python,
                "-c",
                f"import importlib.util, sys; sys.exit(importlib.util.find_spec({absent!r}) is not None)",
            )
            assert probe.returncode == 0, f"{absent} was installed by the base package"

        data = tmp / "d"
        http = _run(
            bin_dir / "modeld", "--data-dir", data, "serve", "--backend", "memory", "--http", "127.0.0.1:0"
        )
        assert http.returncode == 2 and "pip install 'modeld[http]'" in http.stderr

        daemon = subprocess.Popen(
            [
                bin_dir / "modeld",
                "--data-dir",
                data,
                "serve",
                "--backend",
                "memory",
                "--listen",
                f"unix:{tmp}/s.sock",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp,
        )
        try:
            deadline = time.monotonic() + 60
            while (record := read_lease(data)) is None or record.state != "serving":
                assert daemon.poll() is None and time.monotonic() < deadline, (
                    daemon.stderr.read() if daemon.stderr else ""
                )
                time.sleep(0.05)
            out = _run(python, "-c", _CLIENT, data, timeout=120)
            assert out.returncode == 0, out.stderr[-3000:]
            assert out.stdout.split() == ["7", "3", "unsupported", "True", "True"]
            metrics = _run(bin_dir / "modeld", "--data-dir", data, "metrics", timeout=60)
            assert metrics.returncode == 0 and "modeld_prefix_cache_queries_total" in metrics.stdout
        finally:
            daemon.terminate()
            _, err = daemon.communicate(timeout=30)
        assert daemon.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
