#!/usr/bin/env bash
# The whole GPU path, for a machine with an NVIDIA GPU and TensorRT (pip install -e ".[gpu,dev]"):
#   1. the Triton kernels compiled on CUDA against the eager references (bf16 included)
#   2. export -> pre-flight check -> TensorRT engine (AOT and JIT plugins) -> compare with eager
#   3. benchmarks of the MoE lowering and the decoder
# Usage: scripts/gpu_check.sh [OUT_DIR]     (default: gpu_check_out)
set -euo pipefail
out="${1:-gpu_check_out}"
mkdir -p "$out"

python - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")
print("GPU:", torch.cuda.get_device_name())
try:
    import tensorrt
    print("TensorRT:", tensorrt.__version__)
except ImportError:
    sys.exit("gpu_check: TensorRT is not installed (pip install 'moedeploy[gpu]')")
PY

echo "== 1. kernels on CUDA (no interpreter)"
TRITON_INTERPRET=0 python -m pytest -q tests/plugins
# moe::MoENBits on real quantized exports' codes, against ONNX Runtime on the artifact
TRITON_INTERPRET=0 python -m pytest -q tests/export/test_quantized_export.py -k "on_their_codes or shared_experts"

echo "== 2. export, check, build, compare"
for target in rmsnorm moe decoder_layer decoder; do
    for dtype in fp32 fp16 bf16; do
        art="$out/${target}_${dtype}"
        moedeploy export "$target" --dtype "$dtype" --out "$art"
        moedeploy check "$art" --target trt
        moedeploy build "$art" --aot --timing-cache "$out/timing.cache"
        moedeploy compare "$art" --backend trt --iterations 4
        moedeploy build "$art" --jit --timing-cache "$out/timing.cache"
    done
done

echo "== 2b. quantized decoders: the experts on their codes (moe::MoENBits), the other weights on Q/DQ"
for quantize in int8 int4; do
    art="$out/decoder_${quantize}"
    moedeploy export decoder --quantize "$quantize" --out "$art"
    moedeploy check "$art" --target trt
    moedeploy build "$art" --aot --timing-cache "$out/timing.cache"
    moedeploy compare "$art" --backend trt --iterations 4
    moedeploy build "$art" --jit --timing-cache "$out/timing.cache"
done

echo "== 3. benchmarks"
python benchmarks/moe_op.py --json "$out/moe_op.json"
# the grouped MoE kernels at Mixtral's layer size: fp16, int8 and int4 experts, each path
python benchmarks/moe_kernel_nbits.py --tokens 1 4 16 --no-fused --json "$out/moe_kernel_nbits.json"
echo "gpu_check: all steps passed; results under $out"
