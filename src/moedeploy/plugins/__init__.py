"""Custom ops, one module each: eager reference, ONNX node and function body, runtime lowerings."""
