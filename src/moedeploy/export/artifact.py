"""The artifact directory: everything downstream of export reads this, never a live nn.Module.

    <artifact>/model.onnx        (+ model.onnx.data when the weights pass 2 GB)
    <artifact>/manifest.json     what the graph is, its I/O, dynamic ranges, sha256 of every file
    <artifact>/golden/inputs.json    Polygraphy JSON: a list of feed dicts
    <artifact>/golden/outputs.json   Polygraphy RunResults of eager PyTorch on those inputs
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
GOLDEN_INPUTS = "golden/inputs.json"
GOLDEN_OUTPUTS = "golden/outputs.json"
EAGER_RUNNER = "torch-eager"
SCHEMA_VERSION = 1
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf's hard limit is 2 GiB

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: NumPy element type of an artifact's float tensors (NumPy has no bfloat16: bf16 travels as fp32)
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}


class ArtifactError(ValueError):
    """A folder that is not a valid artifact; the message says what is wrong."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"invalid dtype {name!r}; choose one of: {', '.join(DTYPES)}") from None


def quiet_polygraphy() -> None:
    """Polygraphy logs every save/load at INFO to stdout; keep our output clean."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """NumPy has no bfloat16: bf16 tensors are stored as the fp32 values they exactly equal."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def io_spec(values: Any) -> list[dict[str, Any]]:
    """[{name, dtype, shape}] of ONNX graph inputs/outputs, symbolic dims as their names."""
    spec = []
    for v in values:
        tt = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim]
        spec.append({
            "name": v.name,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
            if tt.elem_type != onnx.TensorProto.BFLOAT16 else "bfloat16",
            "shape": dims,
        })
    return spec


def save_model(model: onnx.ModelProto, folder: Path) -> list[str]:
    """Write model.onnx (external data past ~2 GB); returns the files written."""
    if model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(
            model, str(folder / MODEL_FILE), save_as_external_data=True,
            all_tensors_to_one_file=True, location=MODEL_FILE + ".data",
        )
        return [MODEL_FILE, MODEL_FILE + ".data"]
    onnx.save_model(model, str(folder / MODEL_FILE))
    return [MODEL_FILE]


def save_golden(folder: Path, feeds: list[dict[str, np.ndarray]], outputs: list[dict[str, np.ndarray]]) -> list[str]:
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    quiet_polygraphy()
    (folder / "golden").mkdir(exist_ok=True)
    save_json(feeds, str(folder / GOLDEN_INPUTS))
    results = RunResults()
    results.append((EAGER_RUNNER, [IterationResult(o, runtime=0.0, runner_name=EAGER_RUNNER) for o in outputs]))
    results.save(str(folder / GOLDEN_OUTPUTS))
    return [GOLDEN_INPUTS, GOLDEN_OUTPUTS]


@dataclass
class Artifact:
    """A loaded artifact folder: its manifest and where its files are."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> Artifact:
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"artifact {path} is not a folder; create one with `moedeploy export`")
        manifest_file = path / MANIFEST
        if not manifest_file.is_file():
            raise ArtifactError(f"{path} has no {MANIFEST}; is it an artifact made by `moedeploy export`?")
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{manifest_file} is not readable JSON: {e}") from None
        artifact = cls(path, manifest)
        if verify:
            artifact.verify()
        return artifact

    def verify(self) -> None:
        """Every file the manifest lists exists and has its recorded sha256."""
        for rel, digest in self.manifest.get("files", {}).items():
            file = self.path / rel
            if not file.is_file():
                raise ArtifactError(f"{self.path}: {rel} is missing; re-export the artifact")
            if sha256(file) != digest:
                raise ArtifactError(f"{self.path}: {rel} does not match its sha256 in {MANIFEST}; it was modified")

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def input_names(self) -> list[str]:
        return [i["name"] for i in self.manifest["inputs"]]

    def output_names(self) -> list[str]:
        return [o["name"] for o in self.manifest["outputs"]]

    def golden_inputs(self) -> list[dict[str, np.ndarray]]:
        from polygraphy.json import load_json

        quiet_polygraphy()
        return [dict(feed) for feed in load_json(str(self.path / GOLDEN_INPUTS))]

    def golden_outputs(self) -> list[dict[str, np.ndarray]]:
        from polygraphy.comparator import RunResults

        quiet_polygraphy()
        results = RunResults.load(str(self.path / GOLDEN_OUTPUTS))
        return [dict(it) for it in results[0][1]]
