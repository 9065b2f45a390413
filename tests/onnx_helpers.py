"""Independent counts over an exported graph, for tests."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import numpy_helper


def external_initializer_bytes(model_file: Path) -> int:
    """The bytes of the initializers a graph keeps in its data file, each loaded and counted in
    NumPy (4-bit codes two a byte): what the artifact's weights are, whatever the file's layout."""
    external = {t.name for t in onnx.load(str(model_file), load_external_data=False).graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    nibbles = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    return sum((numpy_helper.to_array(t).size + 1) // 2 if t.data_type in nibbles else numpy_helper.to_array(t).nbytes
               for t in onnx.load(str(model_file)).graph.initializer if t.name in external)
