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
    "memory-wire",
    pytest.param("llama-local", marks=pytest.mark.llama),
    pytest.param("llama-wire", marks=pytest.mark.llama),
    pytest.param("openvino-local", marks=pytest.mark.openvino),
    pytest.param("openvino-wire", marks=pytest.mark.openvino),
]


def _harness(name: str) -> Iterator[Harness]:
    backend, transport = name.split("-")
    model = MODELS[backend]()
    factory = wire_harness if transport == "wire" else local_harness
    with factory(model) as h:
        yield h


@pytest.fixture(params=IMPLEMENTATIONS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from _harness(request.param)


@pytest.fixture
def wire() -> Iterator[Harness]:
    yield from _harness("memory-wire")
