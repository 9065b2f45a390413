"""Where a quantized decode step's time can go on ONNX Runtime's CPU kernels: each quantized op
of the `small` preset's shapes timed alone, beside the time its bytes take at the machine's
measured read bandwidth.

A decode step of a quantized MoE decoder should be bound by the bytes of codes and scales it
reads. This script asks, op by op, whether ONNX Runtime's kernels are: `com.microsoft::QMoE`
for a layer's experts (one token, top-2 of 8, int4 or int8 in blocks of 32, at accuracy level
4 as moedeploy serves them), the LM head on `MatMulNBits`, one attention projection on
`MatMulNBits`, and `GroupQueryAttention` over an in-place cache. Each op is chained over distinct random weights, and QMoE gets a new token each run, so that
the weights read outgrow the last-level cache where the real model's do (the experts, the LM
head); the small ops stay cache-resident, as they may between steps. Medians of 5 timed batches; machine-specific, never asserted in tests.

    python benchmarks/quantized_ops.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from moedeploy.models.config import preset

BLOCK = 32
OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]


def session(nodes, initializers, inputs, outputs, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "ops", inputs, outputs, initializers)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(helper.make_model(graph, opset_imports=OPSETS).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def per_call_us(run, calls: int, per_run: int) -> float:
    """Median microseconds per op: `run` executes `per_run` ops; 5 batches of `calls` runs."""
    for _ in range(max(3, calls // 10)):
        run()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        batches.append((time.perf_counter() - start) / calls / per_run * 1e6)
    return float(np.median(batches))


def blocked(rng, rows: int, cols: int, bits: int, name: str) -> tuple[list, int]:
    """(initializers: codes, fp32 scales, per-row packed zero points; bytes read) of an (rows, cols)
    weight in the layout MatMulNBits and QMoE take."""
    blocks = cols // BLOCK
    codes = rng.integers(0, 256, (rows, blocks, BLOCK * bits // 8), dtype=np.uint8)
    scales = (rng.random((rows, blocks), dtype=np.float32) * 0.01 + 1e-3)
    zero_points = np.full((rows, -(-blocks * bits // 8)), 0x88 if bits == 4 else 0x80, np.uint8)
    tensors = [numpy_helper.from_array(a, f"{name}.{part}") for a, part in ((codes, "codes"), (scales, "scales"),
                                                                             (zero_points, "zero_points"))]
    return tensors, codes.nbytes + scales.nbytes + zero_points.nbytes


def qmoe_layers(rng, c, bits: int, chain: int, threads: int) -> tuple[float, int]:
    """A layer's router + QMoE (top-k of E experts, SwiGLU), chained; -> (µs, bytes a token reads)."""
    nodes, inits, x, read = [], [], "x", 0
    for layer in range(chain):
        stacks = []
        for part, rows, cols in (("fc1", 2 * c.expert_hidden, c.hidden_size), ("fc2", c.hidden_size, c.expert_hidden)):
            experts = [blocked(rng, rows, cols, bits, f"{layer}.{part}.{e}") for e in range(c.n_experts)]
            for i, kind in enumerate(("codes", "scales", "zero_points")):
                stacked = np.stack([numpy_helper.to_array(t[i]) for t, _ in experts])
                if kind == "codes":
                    stacked = stacked.reshape(c.n_experts, rows, -1)
                inits.append(numpy_helper.from_array(stacked, f"{layer}.{part}.{kind}"))
            read += c.top_k * experts[0][1]
            stacks.append(f"{layer}.{part}")
        router = rng.standard_normal((c.hidden_size, c.n_experts)).astype(np.float32)
        inits.append(numpy_helper.from_array(router, f"{layer}.router"))
        read += router.nbytes
        nodes.append(helper.make_node("MatMul", [x, f"{layer}.router"], [f"{layer}.logits"]))
        fc1, fc2 = stacks
        nodes.append(helper.make_node(
            "QMoE", [x, f"{layer}.logits", f"{fc1}.codes", f"{fc1}.scales", "", f"{fc2}.codes", f"{fc2}.scales", "",
                     "", "", "", f"{fc1}.zero_points", f"{fc2}.zero_points"], [f"{layer}.y"], domain="com.microsoft",
            k=c.top_k, normalize_routing_weights=1, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
            activation_beta=0.0, expert_weight_bits=bits, block_size=BLOCK, accuracy_level=4))
        x = f"{layer}.y"
    s = session(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c.hidden_size])],
                [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], threads)
    # a new token each run, so the routing changes and the experts read come from memory, as in
    # decoding (one token's experts of every layer would fit in a large last-level cache)
    feeds = itertools.cycle([{"x": rng.standard_normal((1, c.hidden_size)).astype(np.float32)} for _ in range(64)])
    return per_call_us(lambda: s.run(None, next(feeds)), 200, chain), read // chain


def matmul_nbits(rng, n: int, k: int, bits: int, chain: int, threads: int) -> tuple[float, int]:
    """`chain` MatMulNBits of (n, k) over distinct weights, each from the same x; -> (µs, bytes)."""
    nodes, inits, outputs, read = [], [], [], 0
    for i in range(chain):
        tensors, nbytes = blocked(rng, n, k, bits, f"w{i}")
        inits += tensors
        read = nbytes
        nodes.append(helper.make_node("MatMulNBits", ["x", *(t.name for t in tensors)], [f"y{i}"],
                                      domain="com.microsoft", K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    s = session(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])], outputs, threads)
    feed = {"x": rng.standard_normal((1, 1, k)).astype(np.float32)}
    return per_call_us(lambda: s.run(None, feed), max(20, 4000 // chain), chain), read


def gqa(rng, c, context: int, chain: int, threads: int, capacity: int = 256) -> float:
    """`chain` GroupQueryAttention nodes, one token on a cache of `context` positions, appended to
    in place (past and present bound to one buffer, as moedeploy's in-place cache); -> µs."""
    d, heads, kv_heads = c.head_dim, c.n_heads, c.n_kv_heads
    inv = 1.0 / (c.rope_theta ** (np.arange(0, d, 2) / d))
    angles = np.outer(np.arange(c.max_positions), inv)
    inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("q", f32, [1, 1, heads * d]), helper.make_tensor_value_info("k", f32, [1, 1, kv_heads * d]),
              helper.make_tensor_value_info("v", f32, [1, 1, kv_heads * d]),
              helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, [])]
    nodes, outputs, x = [], [], "q"
    for i in range(chain):
        inputs += [helper.make_tensor_value_info(f"past_k{i}", f32, [1, kv_heads, capacity, d]),
                   helper.make_tensor_value_info(f"past_v{i}", f32, [1, kv_heads, capacity, d])]
        nodes.append(helper.make_node("GroupQueryAttention", [x, "k", "v", f"past_k{i}", f"past_v{i}", "seqlens_k", "total",
                                                              "cos", "sin"], [f"o{i}", f"k{i}", f"v{i}"], domain="com.microsoft",
                                      num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, scale=d**-0.5))
        outputs += [helper.make_tensor_value_info(f"k{i}", f32, None), helper.make_tensor_value_info(f"v{i}", f32, None)]
        x = f"o{i}"
    s = session(nodes, inits, inputs, [helper.make_tensor_value_info(x, f32, None), *outputs], threads)
    binding = s.io_binding()
    caches = []
    for i in range(chain):
        for past, present in ((f"past_k{i}", f"k{i}"), (f"past_v{i}", f"v{i}")):
            cache = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, kv_heads, capacity, d)).astype(np.float32))
            binding.bind_ortvalue_input(past, cache)
            binding.bind_ortvalue_output(present, cache)
            caches.append(cache)
    binding.bind_output(x)
    for name, width in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
        binding.bind_cpu_input(name, rng.standard_normal((1, 1, width)).astype(np.float32))
    binding.bind_cpu_input("seqlens_k", np.array([context], np.int32))
    binding.bind_cpu_input("total", np.array(context + 1, np.int32))
    return per_call_us(lambda: s.run_with_iobinding(binding), 500, chain)


def main() -> None:
    from moedeploy.bench.machine import cpu_model, last_level_cache_bytes, measure_bandwidth_gbs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chain", type=int, default=8, help="ops chained over distinct weights (8: the preset's layers)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    c = preset("small")
    rng = np.random.default_rng(0)
    bandwidth = measure_bandwidth_gbs(args.threads)
    llc = last_level_cache_bytes()
    cache = f", last-level cache {llc / 2**20:.0f} MiB" if llc else ""
    print(f"{cpu_model()}, {args.threads} threads, {bandwidth:.1f} GB/s read{cache}")
    rows = []

    def report(name: str, us: float, nbytes: int | None) -> None:
        floor = nbytes / bandwidth / 1e3 if nbytes else None
        rows.append({"op": name, "us": us, "bytes": nbytes, "bandwidth_floor_us": floor})
        tail = f"  {nbytes / 1e6:6.2f} MB read, {floor:6.1f} µs at bandwidth ({floor / us:4.0%})" if floor else ""
        print(f"{name:44s} {us:8.1f} µs{tail}")

    for bits in (4, 8):
        report(f"router + QMoE int{bits} (top-{c.top_k} of {c.n_experts})", *qmoe_layers(rng, c, bits, args.chain, args.threads))
    # four heads' worth of weights (76 MB at int8): more than a last-level cache holds, as the
    # head is in a decode step, where the experts' bytes pass through the cache between two reads
    report("LM head, MatMulNBits int8", *matmul_nbits(rng, c.vocab_size, c.hidden_size, 8, 4, args.threads))
    report("LM head, MatMulNBits int4", *matmul_nbits(rng, c.vocab_size, c.hidden_size, 4, 4, args.threads))
    report(f"q projection {c.hidden_size}x{c.hidden_size}, MatMulNBits int4",
           *matmul_nbits(rng, c.n_heads * c.head_dim, c.hidden_size, 4, 16, args.threads))
    report(f"k projection {c.n_kv_heads * c.head_dim}x{c.hidden_size}, MatMulNBits int8",
           *matmul_nbits(rng, c.n_kv_heads * c.head_dim, c.hidden_size, 8, 16, args.threads))
    for context in (64, 150):
        report(f"GroupQueryAttention, {context} positions cached", gqa(rng, c, context, args.chain, args.threads), None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "threads": args.threads, "bandwidth_gbs": bandwidth, "ops": rows}, f, indent=1)


if __name__ == "__main__":
    main()
