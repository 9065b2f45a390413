"""Runners and sessions over artifacts: ONNX Runtime (and TensorRT), generation loops."""
