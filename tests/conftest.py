"""Shared fixtures. ``harness`` runs a test once per implementation of the contract.

The run ends what it started even when it is killed (SIGTERM, SIGHUP) or a teardown never ran:
``tests/helpers/reaper.py``, installed here."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # the helper modules every room imports

import reaper
from harness import Harness, local_harness, model_of, wire_harness


def pytest_configure(config: pytest.Config) -> None:
    """A run killed by SIGTERM or SIGHUP ends what it started first (``reaper.py``)."""

    def say(text: str) -> None:
        capture = config.pluginmanager.get_plugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=False)
        sys.stderr.write(f"\n{text}\n")
        sys.stderr.flush()

    reaper.install(say)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End what a teardown that never ran left running, and say so."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reaper.sweep(reporter.write_line if reporter is not None else print)


IMPLEMENTATIONS = [
    "memory-local",
    "memory-worker",
    "memory-wire",
    pytest.param("llama-local", marks=pytest.mark.llama),
    pytest.param("llama-wire", marks=pytest.mark.llama),
    pytest.param("openvino-local", marks=pytest.mark.openvino),
    pytest.param("openvino-wire", marks=pytest.mark.openvino),
]

# The contract on the generated sliding-window, hybrid and recurrent models (issue 32), opt in:
# MODELD_CONTRACT_ARCHS=all, or names of modeld.testmodels.ARCH_SPECS separated by commas. Six
# models would multiply the suite's time by four, so the default run leaves them out.
_ARCHS = os.environ.get("MODELD_CONTRACT_ARCHS", "")
if _ARCHS:
    from modeld.testmodels import ARCH_SPECS

    _names = [s.name for s in ARCH_SPECS] if _ARCHS == "all" else _ARCHS.split(",")
    IMPLEMENTATIONS += [
        pytest.param(f"llama/{n}-{t}", marks=pytest.mark.llama) for n in _names for t in ("local", "wire")
    ]


def _harness(name: str) -> Iterator[Harness]:
    backend, transport = name.rsplit("-", 1)
    model = model_of(backend)
    if transport == "wire":
        with wire_harness(model) as h:
            yield h
    else:
        with local_harness(model, isolation="process" if transport == "worker" else "auto") as h:
            yield h


@pytest.fixture(params=IMPLEMENTATIONS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from _harness(request.param)


@pytest.fixture
def wire() -> Iterator[Harness]:
    yield from _harness("memory-wire")
