"""Shared fixtures. ``harness`` runs a test once per implementation of the contract."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import MODELS, Harness, local_harness, wire_harness

IMPLEMENTATIONS = [
    "memory-local",
    "memory-worker",
    "memory-wire",
    pytest.param("llama-local", marks=pytest.mark.llama),
    pytest.param("llama-wire", marks=pytest.mark.llama),
    pytest.param("openvino-local", marks=pytest.mark.openvino),
    pytest.param("openvino-wire", marks=pytest.mark.openvino),
]


def _harness(name: str) -> Iterator[Harness]:
    backend, transport = name.split("-")
    model = MODELS[backend]()
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
