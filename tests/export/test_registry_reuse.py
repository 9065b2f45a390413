"""torch.onnx.export's registry of torchlib functions, built once per process while moedeploy
traces (export/onnx_export.py's torchlib_registry_reused): every export gets a copy of its own,
its graph is the bytes torch's own export writes, and torch's builder is back afterwards."""

from __future__ import annotations

import pytest
import torch
from torch.onnx._internal.exporter import _registration

from moedeploy.export.onnx_export import OPSET, _quiet, torchlib_registry_reused


class Tiny(torch.nn.Module):
    """A few operators that torch decomposes and torchlib translates (LayerNorm, GELU, softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.nn.functional.gelu(self.proj(self.norm(x))), dim=-1)


def exported_bytes() -> bytes:
    torch.manual_seed(0)
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(Tiny().eval(), (torch.randn(2, 3, 8),), dynamo=True, opset_version=OPSET,
                                    dynamic_shapes=({0: "batch", 1: "seq"},), optimize=True, verbose=False)
    return program.model_proto.SerializeToString()


def builder() -> object:
    return _registration.ONNXRegistry.__dict__["from_torchlib"]


def test_an_export_on_the_reused_registry_writes_the_bytes_of_torchs_own() -> None:
    own = exported_bytes()
    with torchlib_registry_reused():
        first, second = exported_bytes(), exported_bytes()  # the second on a copy of the first's registry
    assert first == own
    assert second == own


def test_each_export_gets_a_registry_of_its_own() -> None:
    with torchlib_registry_reused():
        first = _registration.ONNXRegistry.from_torchlib(opset_version=OPSET)
        second = _registration.ONNXRegistry.from_torchlib(opset_version=OPSET)
        assert first is not second and first.opset_version == second.opset_version == OPSET
        assert first.functions.keys() == second.functions.keys() and len(first.functions) > 500
        op, key = torch.ops.aten.gelu.default, "aten::gelu"  # the registry's key for the operator
        before = list(second.functions[key])
        first.register_op(op, lambda x: x)  # what custom_translation_table does to one export's registry
        assert len(first.functions[key]) == len(before) + 1
        assert second.functions[key] == before
        assert _registration.ONNXRegistry.from_torchlib(opset_version=OPSET).functions[key] == before


def test_an_older_opset_gets_its_own_registry() -> None:
    with torchlib_registry_reused():
        newer = _registration.ONNXRegistry.from_torchlib(opset_version=OPSET)
        older = _registration.ONNXRegistry.from_torchlib(opset_version=18)
    assert (newer.opset_version, older.opset_version) == (OPSET, 18)


def test_torchs_builder_is_back_after_the_last_export_also_after_a_failure() -> None:
    own = builder()
    first, second = torchlib_registry_reused(), torchlib_registry_reused()
    first.__enter__()
    assert builder() is not own
    second.__enter__()
    first.__exit__(None, None, None)
    assert builder() is not own  # the second export is still tracing
    second.__exit__(None, None, None)
    assert builder() is own
    with pytest.raises(RuntimeError, match="trace failed"), torchlib_registry_reused():
        raise RuntimeError("trace failed")
    assert builder() is own


STALE = """
import logging, sys, torch
logging.disable(logging.CRITICAL)
from moedeploy.export.onnx_export import OPSET, _quiet, torchlib_registry_reused

assert "torch.ao.quantization.fx._decomposed" not in sys.modules
class Identity(torch.nn.Module):
    def forward(self, x):
        return x + 1
class QDQ(torch.nn.Module):
    def forward(self, x):
        q = torch.ops.quantized_decomposed.quantize_per_tensor(x, 0.1, 0, -128, 127, torch.int8)
        return torch.ops.quantized_decomposed.dequantize_per_tensor(q, 0.1, 0, -128, 127, torch.int8)
def ops(module):
    with _quiet():
        program = torch.onnx.export(module.eval(), (torch.randn(4),), dynamo=True, opset_version=OPSET, verbose=False)
    return [n.op_type for n in program.model_proto.graph.node]
with torchlib_registry_reused():
    ops(Identity())  # the registry is built before quantized_decomposed's operators exist
import torch.ao.quantization.fx._decomposed  # noqa: E402 (registers them)
with torchlib_registry_reused():
    print(ops(QDQ()))
"""


def test_operators_registered_after_the_first_export_reach_the_next() -> None:
    """A library imported after the registry was built (here torch.ao's quantized_decomposed
    operators, as torchvision's would be) changes what torch's builder makes: the reused registry
    is rebuilt, and the export maps them as torch's own does (a fresh interpreter, where they are
    not loaded yet)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STALE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['QuantizeLinear', 'DequantizeLinear']"


def test_a_patch_made_by_someone_else_inside_the_window_is_left_to_them() -> None:
    """Our exit puts torch's builder back only where ours still is: a mock set inside stays."""
    from unittest import mock

    own = builder()
    reuse = torchlib_registry_reused()
    reuse.__enter__()
    theirs = mock.patch.object(_registration.ONNXRegistry, "from_torchlib", classmethod(lambda cls, **_: "theirs"))
    theirs.start()
    reuse.__exit__(None, None, None)
    assert _registration.ONNXRegistry.from_torchlib() == "theirs"
    theirs.stop()  # restores what it found, ours, which still reuses correctly
    _registration.ONNXRegistry.from_torchlib = own
