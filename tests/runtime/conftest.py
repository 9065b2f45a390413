"""Fixtures for the runtime tests: artifacts come from the session-wide store that the
export tests share, so nothing is exported twice."""

from __future__ import annotations

import pytest

from tests.export.artifacts import ArtifactStore


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    return ArtifactStore.for_session(tmp_path_factory)
