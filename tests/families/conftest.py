"""Every family's fp32 artifact, exported by the CLI from its saved Hugging Face folder once per
test session and shared by the modules that read it (test_onnx, test_tools): an export of these
tiny models is 4-9 s of torch.onnx tracing, so each is made on first request only."""

from __future__ import annotations

from pathlib import Path

import pytest

from moedeploy.export.artifact import Artifact

from .cases import cases, make_model, save_checkpoint

#: the seed every shared export's weights are drawn with
SEED = 1


class CliExports:
    """case id -> (transformers model, fp32 artifact exported from its saved folder by the CLI)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # every configuration of every family, in 2 layers: each family's mix of dense and MoE,
        # sliding and full layers survives the cut (tests/families/cases.py), and a 2-layer export
        # traces in two thirds of a 3-layer one's time
        self.configs = cases(n_layers=2)
        self._done: dict[str, tuple[object, Artifact]] = {}

    def __call__(self, case: str) -> tuple[object, Artifact]:
        if case not in self._done:
            from typer.testing import CliRunner

            from moedeploy.cli import app

            hf = make_model(self.configs[case], seed=SEED)
            root = self.root / case
            save_checkpoint(hf, root / "checkpoint")
            result = CliRunner().invoke(app, ["export", "decoder", "--checkpoint", str(root / "checkpoint"),
                                              "--out", str(root / "artifact")])
            assert result.exit_code == 0, result.output
            assert "exported decoder (fp32)" in result.stdout
            self._done[case] = hf, Artifact.load(root / "artifact")
        return self._done[case]


@pytest.fixture(scope="session")
def cli_exports(tmp_path_factory) -> CliExports:
    return CliExports(tmp_path_factory.mktemp("family-exports"))
