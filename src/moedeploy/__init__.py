"""moedeploy: PyTorch transformer blocks and MoE decoders to ONNX Runtime and TensorRT, proven right."""

__version__ = "0.1.0"
