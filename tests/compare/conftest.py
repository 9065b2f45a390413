"""Artifacts for the comparison tests, exported once per session.

The blocks and the tiny decoder come from the session-wide store that tests/export and
tests/runtime share (the same `export` call with the same defaults: fp32, seed 0, BatchNorm
folded), so none of them is exported twice in one run. Tests never compare the shared
artifacts in place (compare writes <artifact>/report/): they take a private copy with
`fresh_copy`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moedeploy.compare.api import compare
from moedeploy.export import export
from moedeploy.export.artifact import Artifact
from moedeploy.models import DecoderConfig, MoEDecoder, RMSNorm
from tests.compare.helpers import COMPARED_ITERATIONS, fresh_copy
from tests.export.artifacts import ArtifactStore

# Four layers, so "the first divergent layer" has somewhere to be besides the ends.
DEEP_CONFIG = DecoderConfig(
    vocab_size=96, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=3, top_k=2,
    expert_hidden=48, max_positions=128, rope_theta=10000.0,
)


class Store:
    def __init__(self, root: Path, shared: ArtifactStore) -> None:
        self.root = root
        self.shared = shared
        self._cache: dict[str, Artifact] = {}

    def block(self, name: str, dtype: str = "fp32") -> Artifact:
        """`export(name, dtype=dtype)` with its defaults (seed 0, BatchNorm folded)."""
        return self.shared.block(name, dtype)

    def decoder(self) -> Artifact:
        """The tiny preset (2 layers), seed 0."""
        return self.shared.decoder("fp32")

    def checkpoint_decoder(self, name: str, config: DecoderConfig) -> Artifact:
        """A decoder exported from a checkpoint; its norm weights are random (not all ones),
        so each norm keeps its own initializer in the graph."""
        if name not in self._cache:
            with torch.random.fork_rng(), torch.no_grad():  # leave the global RNG as it was
                torch.manual_seed(1234)
                model = MoEDecoder(config)
                for m in model.modules():
                    if isinstance(m, RMSNorm):
                        m.weight.copy_(1 + 0.2 * torch.randn_like(m.weight))
            checkpoint = self.root / f"{name}-checkpoint"
            model.save_pretrained(checkpoint)
            self._cache[name] = export("decoder", self.root / name, checkpoint=checkpoint)
        return self._cache[name]

    def deep_decoder(self) -> Artifact:
        return self.checkpoint_decoder("deep-decoder", DEEP_CONFIG)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(tmp_path_factory.mktemp("compare-artifacts"), ArtifactStore.for_session(tmp_path_factory))


@pytest.fixture(scope="session")
def compared_decoder(artifacts: Store, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A copy of the tiny decoder compared once (3 iterations, layer-wise): read, never rewritten."""
    folder = fresh_copy(artifacts.decoder(), tmp_path_factory.mktemp("compared") / "decoder")
    return folder, compare(folder, iterations=COMPARED_ITERATIONS, seed=0, layerwise=True)
