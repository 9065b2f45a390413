"""Ahead-of-time compilation of the plugin kernels to PTX, as TensorRT's `aot_impl` needs.

Works without a GPU: Triton lowers to PTX for a named target, so CI can check that every
kernel compiles and has the parameter list TensorRT will launch it with.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import triton

from moedeploy.models.blockquant import QuantScheme
from moedeploy.plugins.kernels.moe import activation_params, as_routing, routing_params
from moedeploy.plugins.kernels.moe_fused import (
    FUSED_BLOCKS,
    moe_fused_kernel,
    moe_fused_nbits_kernel,
)
from moedeploy.plugins.kernels.rmsnorm import MAX_BLOCK, rms_norm_kernel
from moedeploy.plugins.moe import ExpertActivation, Routing, as_activation

TRITON_TYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
RMS_NORM_BLOCK = 1024  # the AOT kernel cannot see H at compile time; it loops over chunks


@dataclass(frozen=True)
class AotKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int
    global_scratch: int  # bytes of Triton's hidden scratch buffers: TensorRT cannot provide any


def _target(arch: int | None):
    if arch is None:
        return None  # the current GPU
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], arch: int | None) -> AotKernel:
    src = triton.compiler.ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    compiled = triton.compile(src, target=_target(arch))
    meta = compiled.metadata
    scratch = int(getattr(meta, "global_scratch_size", 0) or 0) + int(getattr(meta, "profile_scratch_size", 0) or 0)
    return AotKernel(meta.name, compiled.asm["ptx"], meta.num_warps, meta.shared, scratch)


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(rms_norm_kernel, InterpretedFunction)


class _CleanCompiler:
    """A fresh Python with Triton's interpreter off, kept while this process lives.

    Triton's interpreter patches triton.language process-wide, so compiling next to it is
    unreliable (CPU tests only): kernels compile in another process instead. One process
    serves every request in turn (a JSON line each way), because starting one per kernel
    spent 4-5 s importing torch and Triton for about 1 s of compiling. Any exchange that does
    not end in its reply (an interrupt, a line that is not JSON, the process gone) ends that
    process, so a reply left in the pipe is never read as the next request's. A change to the
    variables Triton's compiler reads (TRITON_*, and PATH, where ptxas is looked up) starts a
    new one, which sees them as a process per kernel did.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None
        self._env: dict[str, str] = {}

    def compile(self, kind: str, kwargs: dict) -> AotKernel:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self._env != _compiler_env():
                self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps([kind, kwargs]) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                reply = json.loads(line) if line else None
            except (OSError, ValueError):  # a closed pipe, or a line that is not a reply
                reply = None
            except BaseException:  # interrupted: its reply would be read by the next request
                self._close()
                raise
            if not isinstance(reply, dict) or not ({"kernel", "error"} & reply.keys()):
                self._stderr.seek(0)
                why = self._stderr.read()[-2000:]
                self._close()  # and the next request starts a new one
                raise RuntimeError(f"AOT compilation of {kind} failed: the compiling process exited or answered "
                                   f"out of turn:\n{why}")
        if "error" in reply:
            raise RuntimeError(f"AOT compilation of {kind} failed:\n{reply['error'][-2000:]}")
        return AotKernel(**reply["kernel"])

    def _start(self) -> None:
        self._close()
        self._env = _compiler_env()
        # its stderr in a file, as a pipe nobody reads could fill and block it
        self._stderr = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115 (kept as long as the process)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moedeploy.plugins.kernels.aot"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True, env={**os.environ, "TRITON_INTERPRET": "0"},
        )

    def close(self) -> None:
        """End the process (its stdin closed, it exits) once no request is under way."""
        if self._lock.acquire(timeout=10):  # at exit, a thread stuck in a request must not hold it up
            try:
                self._close()
            finally:
                self._lock.release()

    def _close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _compiler_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("TRITON_") or k == "PATH"}


_clean_compiler = _CleanCompiler()
atexit.register(_clean_compiler.close)


def _in_clean_process(kind: str, kwargs: dict) -> AotKernel:
    return _clean_compiler.compile(kind, kwargs)


def _serve_requests() -> None:
    """The clean process's loop: a JSON [kind, kwargs] line in, a {"kernel"} or {"error"} line out.

    Replies go to a copy of the original stdout; file descriptor 1 itself is pointed at stderr,
    so nothing else written there (C code, ptxas run by Triton) can land between two replies.
    """
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    compile_fns = {"rms_norm": compile_rms_norm, "moe_fused": _compile_moe_fused_from_json}
    for line in sys.stdin:
        kind, kwargs = json.loads(line)
        try:
            reply = {"kernel": dataclasses.asdict(compile_fns[kind](**kwargs))}
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def compile_rms_norm(dtype: str, eps: float, arch: int | None = None) -> AotKernel:
    """rms_norm_kernel(X, W, stride_x, stride_y, H, Y) with eps and BLOCK baked in."""
    if _interpreting():
        return _in_clean_process("rms_norm", {"dtype": dtype, "eps": eps, "arch": arch})
    t = TRITON_TYPES[dtype]
    signature = {"X": f"*{t}", "W": f"*{t}", "stride_x": "i32", "stride_y": "i32", "H": "i32", "Y": f"*{t}"}
    return _compile(rms_norm_kernel, signature, {"eps": float(eps), "BLOCK": min(RMS_NORM_BLOCK, MAX_BLOCK)}, arch)


def compile_moe_fused(
    dtype: str, top_k: int | Routing, normalize_topk: bool = True, activation: str | ExpertActivation = "swiglu",
    *, n_experts: int, quantized: QuantScheme | None = None, interleaved: bool = False, arch: int | None = None,
) -> AotKernel:
    """moe_fused_kernel(X, LOGITS, WG, WU, WD, BG, BU, BD, SCORE_BIAS, H, I, E, Y) with the
    routing (a Routing, or top_k and normalize_topk of softmax routing) and activation (an
    ExpertActivation, or a name with default parameters) baked in. With `quantized` (the
    experts' int8/int4 scheme) it is moe_fused_nbits_kernel(X, LOGITS, WG, SG, ZG, WU, SU, ZU,
    WD, SD, ZD, BG, BU, BD, SCORE_BIAS, H, I, E, Y): each stack's codes (uint8 bytes), `dtype`
    scales and uint8 zero points (unread for signed codes), the bits, block size and signedness
    baked in. `interleaved`: WG and WU are one (E, 2I, H) stack, the gate in its even rows and
    the up in its odd ones (the kernel takes the same pointer twice).

    Every routing variant compiles (the kernel routes with `route_token`); SCORE_BIAS is fp32
    whatever `dtype` is, as the node's score_bias input.
    """
    routing = as_routing(top_k, normalize_topk)
    act = as_activation(activation)
    routing.check(n_experts)
    if _interpreting():
        kwargs = {"dtype": dtype, "routing": routing.attributes(), "activation": act.attributes(),
                  "n_experts": n_experts, "interleaved": interleaved, "arch": arch}
        if quantized is not None:
            kwargs["quantized"] = dataclasses.asdict(quantized)
        return _in_clean_process("moe_fused", kwargs)
    t = TRITON_TYPES[dtype]
    constexprs = {
        **routing_params(routing), **activation_params(act),
        "BLOCK_E": triton.next_power_of_2(n_experts), **FUSED_BLOCKS, "INTERLEAVED": interleaved,
    }
    signature = {"X": f"*{t}", "LOGITS": f"*{t}"}
    for stack in ("G", "U", "D"):
        if quantized is None:
            signature[f"W{stack}"] = f"*{t}"
        else:
            signature.update({f"W{stack}": "*u8", f"S{stack}": f"*{t}", f"Z{stack}": "*u8"})
    signature.update({"BG": f"*{t}", "BU": f"*{t}", "BD": f"*{t}"})
    signature.update({"SCORE_BIAS": "*fp32", "H": "i32", "I": "i32", "E": "i32", "Y": f"*{t}"})
    if quantized is None:
        return _compile(moe_fused_kernel, signature, constexprs, arch)
    constexprs.update({"BITS": quantized.bits, "QBLOCK": quantized.block_size, "SIGNED": quantized.signed})
    return _compile(moe_fused_nbits_kernel, signature, constexprs, arch)


def _compile_moe_fused_from_json(routing: dict, activation: dict, quantized: dict | None = None, **kwargs) -> AotKernel:
    # json carries an infinite swiglu_limit as Infinity, which json.loads reads back
    return compile_moe_fused(
        top_k=Routing.from_attributes(routing), activation=ExpertActivation.from_attributes(activation),
        quantized=None if quantized is None else QuantScheme(**quantized), **kwargs,
    )


if __name__ == "__main__":  # the clean process of _CleanCompiler
    _serve_requests()
