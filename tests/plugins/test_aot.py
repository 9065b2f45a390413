"""The AOT path of the TensorRT plugins, checked without a GPU: Triton compiles the plugin
kernels to PTX for a named GPU target, and the PTX entry must take exactly the arguments
TensorRT launches an AOT plugin kernel with: input pointers, int32 scalars, output pointers.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (it comes with the dev extra)", allow_module_level=True)

from moedeploy.models.blockquant import QuantScheme
from moedeploy.plugins.kernels.aot import compile_moe_fused, compile_rms_norm
from moedeploy.plugins.moe import ExpertActivation, Routing

# Triton >= 3.3 appends two pointer parameters (global and profile scratch) to every kernel.
# TensorRT does not pass them, which is harmless only if the kernel never uses them.
TRITON_HIDDEN_PARAMS = 2


def _entry_params(ptx: str) -> list[str]:
    start = ptx.index(".entry")
    return re.findall(r"\.param \.(\w+)", ptx[start:ptx.index(")", start)])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_rms_norm_aot_kernel_matches_tensorrt_launch(dtype: str) -> None:
    kernel = compile_rms_norm(dtype, 1e-5, arch=90)
    params = _entry_params(kernel.ptx)
    # X, W (pointers) | stride_x, stride_y, H (int32) | Y (pointer)
    assert params[: len(params) - TRITON_HIDDEN_PARAMS] == ["u64", "u64", "u32", "u32", "u32", "u64"]
    assert kernel.global_scratch == 0
    assert kernel.name == "rms_norm_kernel" and kernel.num_warps >= 1


# Every routing variant compiles into the one fused kernel (routing constants are constexprs).
AOT_ROUTINGS = [
    Routing(2, True),
    Routing(3, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
    Routing(2, scoring="sparsemixer", jitter_eps=0.3),
]


@pytest.mark.parametrize("routing", AOT_ROUTINGS, ids=["softmax", "sigmoid-grouped", "sparsemixer"])
def test_moe_fused_aot_kernel_matches_tensorrt_launch(routing: Routing) -> None:
    kernel = compile_moe_fused("fp16", routing, activation="swiglu", n_experts=8, arch=90)
    params = _entry_params(kernel.ptx)
    # X, LOGITS, WG, WU, WD, BG, BU, BD, SCORE_BIAS (pointers) | H, I, E (int32) | Y (pointer)
    assert params[: len(params) - TRITON_HIDDEN_PARAMS] == ["u64"] * 9 + ["u32"] * 3 + ["u64"]
    assert kernel.global_scratch == 0
    assert ".target sm_90" in kernel.ptx


def test_quantized_moe_fused_aot_kernel_matches_tensorrt_launch() -> None:
    """The int8/int4 experts' kernel: each stack's codes, scales and zero points are inputs (the
    bit width is a constant of the kernel: int8's signature is the same)."""
    kernel = compile_moe_fused("fp16", Routing(2, True), n_experts=8, quantized=QuantScheme(4, 32), arch=90)
    params = _entry_params(kernel.ptx)
    # X, LOGITS, (WG, SG, ZG), (WU, SU, ZU), (WD, SD, ZD), BG, BU, BD, SCORE_BIAS | H, I, E | Y
    assert params[: len(params) - TRITON_HIDDEN_PARAMS] == ["u64"] * 15 + ["u32"] * 3 + ["u64"]
    assert kernel.name == "moe_fused_nbits_kernel" and kernel.global_scratch == 0
    assert ".target sm_90" in kernel.ptx
    # moe::MoENBits on an interleaved gate/up stack: the same launch (the pointer passed twice)
    interleaved = compile_moe_fused("fp16", Routing(2, True), n_experts=8, quantized=QuantScheme(4, 32),
                                    interleaved=True, arch=90)
    assert _entry_params(interleaved.ptx) == params and interleaved.ptx != kernel.ptx


def test_moe_fused_aot_bakes_in_opset_3_attributes() -> None:
    """DeepSeek-V2's max group scoring and gpt-oss's clamped SwiGLU compile into the same
    launch signature; the limits +7 and -7 (0f40E00000, 0fC0E00000) are constants of the kernel."""
    routing = Routing(3, False, n_group=4, topk_group=2, routed_scaling_factor=16.0, group_scoring="max")
    gpt_oss = ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    kernel = compile_moe_fused("bf16", routing, activation=gpt_oss, n_experts=16, arch=90)
    params = _entry_params(kernel.ptx)
    assert params[: len(params) - TRITON_HIDDEN_PARAMS] == ["u64"] * 9 + ["u32"] * 3 + ["u64"]
    assert kernel.global_scratch == 0
    assert "0f40E00000" in kernel.ptx and "0fC0E00000" in kernel.ptx  # neither is there without the clamp


def test_moe_fused_aot_refuses_what_the_op_refuses() -> None:
    # checked before any compilation (no subprocess)
    with pytest.raises(ValueError, match="n_group"):
        compile_moe_fused("fp16", Routing(2, n_group=4, topk_group=2), n_experts=4, arch=90)
    with pytest.raises(ValueError, match="activation"):
        compile_moe_fused("fp16", 2, activation="tanh", n_experts=4, arch=90)


def test_the_clean_compiling_process_reports_a_failure_and_outlives_it() -> None:
    """On CPU the kernels compile in one kept process with Triton's interpreter off: a request it
    cannot compile is an error naming the cause, the next request still compiles, and a process
    that died is replaced."""
    from moedeploy.plugins.kernels import aot

    if not aot._interpreting():
        pytest.skip("kernels compile in this process here (Triton's interpreter is off)")
    with pytest.raises(RuntimeError, match=r"AOT compilation of rms_norm failed:(.|\n)*TypeError"):
        aot._in_clean_process("rms_norm", {"dtype": "fp32", "eps": 1e-5, "arch": 90, "no_such_option": 1})
    first = aot._clean_compiler._proc
    assert first is not None and first.poll() is None  # the same process goes on
    assert compile_rms_norm("fp32", 1e-6, arch=90).name == "rms_norm_kernel"
    assert aot._clean_compiler._proc is first
    first.kill()
    first.wait()
    kernel = compile_rms_norm("fp16", 1e-6, arch=80)
    assert ".target sm_80" in kernel.ptx and aot._clean_compiler._proc is not first


class _StandIn:
    """A _CleanCompiler whose process is a stand-in script (reads the request, then `script`)."""

    @staticmethod
    def make(script: str):
        import subprocess
        import sys
        import tempfile

        from moedeploy.plugins.kernels import aot

        class StandIn(aot._CleanCompiler):
            def _start(self) -> None:
                self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by _close())
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", f"import sys, time; sys.stdin.readline(); {script}"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)

        return StandIn()


@pytest.mark.parametrize("script", [
    "sys.exit('out of memory, say')",  # gone, with its last words on stderr
    "sys.stderr.write('out of memory, say'); sys.stderr.flush(); print('ptxas says hello', flush=True)",  # not a reply
])
def test_a_compiling_process_that_dies_or_answers_out_of_turn_is_an_error_and_is_replaced(script: str) -> None:
    compiler = _StandIn.make(script)
    with pytest.raises(RuntimeError, match=r"exited or answered out of turn:\n.*out of memory, say"):
        compiler.compile("rms_norm", {"dtype": "fp32", "eps": 1e-5, "arch": 90})
    assert compiler._proc is None and compiler._stderr is None  # the next request starts a new one


def test_an_interrupted_request_ends_its_process_so_its_reply_is_never_taken_for_the_next() -> None:
    """A reply still on its way when the request was interrupted (Ctrl-C) would otherwise be
    read as the next request's: a kernel compiled for other arguments, and no error."""
    import signal

    compiler = _StandIn.make("time.sleep(1); print('{\"kernel\": {}}', flush=True)")

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            compiler.compile("rms_norm", {"dtype": "fp32", "eps": 1e-5, "arch": 90})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert compiler._proc is None


def test_the_clean_compiling_process_sees_a_changed_environment(monkeypatch) -> None:
    """A process per kernel saw the environment of its request (TRITON_CACHE_DIR, say); the kept
    one is replaced when a variable the compiler reads changed since it started."""
    from moedeploy.plugins.kernels import aot

    if not aot._interpreting():
        pytest.skip("kernels compile in this process here (Triton's interpreter is off)")
    compile_rms_norm("fp32", 1e-5, arch=90)
    first = aot._clean_compiler._proc
    compile_rms_norm("fp32", 1e-4, arch=90)
    assert aot._clean_compiler._proc is first
    monkeypatch.setenv("MOEDEPLOY_TEST_MARK", "1")  # not one of them
    compile_rms_norm("fp32", 1e-3, arch=90)
    assert aot._clean_compiler._proc is first
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")
    compile_rms_norm("fp32", 1e-2, arch=90)
    assert aot._clean_compiler._proc is not first
