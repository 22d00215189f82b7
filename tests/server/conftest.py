"""Fixtures: one server on the demo artifact (``demo_artifact``, tests/conftest.py) for the session."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_harness import LiveServer


@pytest.fixture(scope="session")
def server(demo_artifact):
    s = LiveServer(demo_artifact)
    yield s
    s.stop()
