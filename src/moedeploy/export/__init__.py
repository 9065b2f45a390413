"""nn.Module -> artifact directory (ONNX with custom ops, manifest, golden I/O); BatchNorm folding."""

from moedeploy.export.artifact import Artifact, ArtifactError, parse_dtype
from moedeploy.export.blocks import BLOCKS, BlockSpec, get_block
from moedeploy.export.exporter import DECODER, export, export_block, export_decoder
from moedeploy.export.fold import ChannelAffine, calibrate, fold_batchnorms
from moedeploy.export.onnx_export import OPSET, ExportError, to_onnx

__all__ = [
    "BLOCKS",
    "DECODER",
    "OPSET",
    "Artifact",
    "ArtifactError",
    "BlockSpec",
    "ChannelAffine",
    "ExportError",
    "calibrate",
    "export",
    "export_block",
    "export_decoder",
    "fold_batchnorms",
    "get_block",
    "parse_dtype",
    "to_onnx",
]
