"""The coding agents the agent-API tests run are installed and start (scripts/install_agents.sh).

Skips, with the install script's reason, only when the npm registry is unreachable.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from agents import INSTALL_SCRIPT, AgentsInstallError, ensure_agents, parse_install_output


def pinned_versions() -> dict[str, str]:
    """name -> version, read from the install script's AGENTS list."""
    text = INSTALL_SCRIPT.read_text()
    return {name: version for name, version in re.findall(r'"(\w+)=@[\w./-]+@([\w.-]+)"', text)}


def test_install_output_parses_and_each_agent_runs_its_pinned_version(tmp_path: Path) -> None:
    agents = ensure_agents()
    pinned = pinned_versions()
    assert set(pinned) == {"claude", "codex"}

    # Installed already: the script answers from its cache with the same paths.
    again = subprocess.run(
        ["bash", str(INSTALL_SCRIPT), "--cached-only"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert parse_install_output(again.stdout) == {"claude": agents.claude, "codex": agents.codex}

    for name, binary in (("claude", agents.claude), ("codex", agents.codex)):
        assert binary.is_file() and os.access(binary, os.X_OK), binary
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path),
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CODEX_HOME": str(tmp_path / "codex"),
        }
        (tmp_path / "codex").mkdir(exist_ok=True)
        proc = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        assert pinned[name] in proc.stdout, (name, proc.stdout)

    with pytest.raises(AgentsInstallError, match="unexpected line"):
        parse_install_output("claude=/x\nnpm WARN something\n")
    with pytest.raises(AgentsInstallError, match="codex"):
        parse_install_output("claude=/x\n")
