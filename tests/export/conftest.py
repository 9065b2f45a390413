"""Fixtures for the export tests: artifacts are exported once per session (see artifacts.py)."""

from __future__ import annotations

import pytest

from tests.export.artifacts import ArtifactStore


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    return ArtifactStore.for_session(tmp_path_factory)
