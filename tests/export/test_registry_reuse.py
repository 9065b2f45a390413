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
