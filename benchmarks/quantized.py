"""Weight-only int8/int4 beside fp32, and beside llama.cpp's f32/q8_0/q4_0 and OpenVINO's
fp32/int8/int4, on the same weights, in one interleaved run: decode tokens/s, prefill, the bytes of weights a decode token reads, and the
accuracy of each against the fp32 eager model.

moedeploy's int8/int4 artifacts are exported from the same preset (`moedeploy export decoder
--quantize`; int4 mixed, the default: the LM head and attention K/V at int8, as llama.cpp's
q4_0 keeps its output at Q6_K and K/V at Q8_0 for a MoE model) and run on ONNX Runtime through the MatMulNBits lowering, timed at accuracy level 4
(int8 activations, as bench runs a quantized artifact; accuracy is reported at 4 and at the
float level 0, `*_level0` in the JSON); llama.cpp's q8_0/q4_0 are
made by llama.cpp's own quantizer from the f32 GGUF `bench --peers` writes. OpenVINO's rows run
the graph `ort` runs (the fp32 peer of `bench --peers`), its int8/int4 compressed by NNCF as
optimum-intel's --weight-format does (int8 per output channel, int4 in groups of --block-size,
NNCF keeping the embedding and LM head at int8; `moedeploy.bench.openvino_peer.compressed_ir`),
at f32 activations with OpenVINO's default dynamic quantization of them for compressed weights.
Every system runs in fresh worker processes, interleaved over --rounds, like `moedeploy bench
--rounds`.

Accuracy, on a fixed seeded token stream of --stream tokens (one teacher-forced pass): mean and
max KL(fp32 || system) of the next-token distributions, top-1 agreement with fp32, the max
logit error; and greedy agreement: the share of 64 greedy tokens (after a 128-token prompt)
equal to fp32 eager's. The small preset has random weights, so its logits are near flat and
top-1 flips easily: this measures the formats against each other, not a trained model's loss.

    python benchmarks/quantized.py small [--backend ort-gqa] [--rounds 3] [--stream 512] [--no-llama] [--no-openvino] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
from pathlib import Path

import numpy as np
import torch

#: llama.cpp's type, bits per weight with its scale, and its output (LM head) tensor's (q4_0 keeps it at Q6_K)
LLAMA_FORMATS = {"int8": ("q8_0", 8.5, 8.5), "int4": ("q4_0", 4.5, 6.5625)}
#: OpenVINO's (NNCF's) bits per weight with its fp16 scales, and its LM head's (int8 per channel)
OPENVINO_BITS = {"int8": (8.0, 8.0), "int4": (4.5, 8.0)}


def llama_quantized(f32_gguf: Path, kind: str) -> Path:
    """llama.cpp's own quantization of the f32 GGUF (llama_model_quantize), cached beside it: reused
    while it is newer than the f32 file and its bytes are those written (its sha256 sidecar)."""
    import llama_cpp

    from moedeploy.bench.gguf import digest_problem, record_digest

    out = f32_gguf.with_name(f32_gguf.name.replace("-f32.gguf", f"-{kind}.gguf"))
    if out.is_file() and out.stat().st_mtime >= f32_gguf.stat().st_mtime:
        if (problem := digest_problem(out)) is None:
            return out
        print(f"llama.cpp: {problem}: quantizing again")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    tmp = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(f32_gguf).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f32_gguf} to {kind}")
    record_digest(tmp, out)
    return out


def peer_step_bytes(config, context: int, bits: float, head_bits: float) -> float:
    """Bytes a peer's decode token reads: the weights moedeploy quantizes (attention, experts,
    the LM head) at the peer's bits per weight, scales included (`bits`, the LM head at
    `head_bits`), the router, norms and KV cache in fp32: moedeploy's arithmetic (bench's
    roofline) with the peer's formats."""
    from moedeploy.bench.roofline import decode_step_bytes

    total = decode_step_bytes(config, 1, context)
    c = config
    fp32_part = 4 * (c.n_layers * (c.hidden_size * c.n_experts + 2 * c.hidden_size) + 2 * c.hidden_size)
    kv = total - decode_step_bytes(config, 1, 0)
    head = c.hidden_size * c.vocab_size
    quantized_params = (total - kv - fp32_part) / 4 - head
    return quantized_params * bits / 8 + head * head_bits / 8 + fp32_part + kv


def ort_logits(artifact, tokens: torch.Tensor, threads: int, nbits_accuracy: int) -> np.ndarray:
    from moedeploy.runtime.generation import OrtDecoder

    decoder = OrtDecoder(artifact, threads=threads, nbits_accuracy=nbits_accuracy)  # (no effect on a float graph)
    decoder.reset(1, tokens.shape[1])
    return decoder.step(tokens, 0)[0].numpy()


def llama_logits(gguf: Path, tokens: torch.Tensor, threads: int, extra_buffers: bool = True) -> tuple[np.ndarray, dict]:
    """llama.cpp's teacher-forced logits, in a child process (a llama.cpp crash costs its row, not the
    run), and the row's note when its extra weight buffers had to be off (`{}` when not)."""
    from moedeploy.bench.peers import llama_stream_logits_in_child

    logits, note = llama_stream_logits_in_child(str(gguf), tokens[0].tolist(), threads, extra_buffers)
    return logits, {"note": note} if note else {}


def print_notes(rows: list[dict]) -> None:
    """The rows' notes (a llama.cpp row run without its extra weight buffers), one line each."""
    for row in rows:
        if row.get("note"):
            print(f"note: {row['system']}: {row['note']}")


def openvino_logits(artifact, compressed: Path | None, tokens: torch.Tensor, threads: int) -> np.ndarray:
    """Teacher-forced logits of every position, a token per step through the stateful model
    (its graph computes the LM head on the last position only)."""
    from moedeploy.bench.openvino_peer import openvino_stepper

    reset, step, _ = openvino_stepper(artifact, threads, str(compressed) if compressed else None)
    reset(1, tokens.shape[1])
    return np.concatenate([step(tokens[:, i:i + 1], i).numpy() for i in range(tokens.shape[1])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", default="small")
    parser.add_argument("--backend", default="ort-gqa", help="the ONNX Runtime backend of moedeploy's rows")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream", type=int, default=512, help="tokens of the teacher-forced accuracy stream")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--no-openvino", action="store_true", help="leave OpenVINO out")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from moedeploy.bench.report_file import at_least, script_report_check, write_script_report

    at_least(parser, args, {"--rounds": 1, "--repeat": 1, "--threads": 1, "--stream": 2})
    script_report_check(parser, args.json, "quantized")

    from moedeploy.bench.api import (
        cache_dir,
        is_checkpoint,
        merge_rounds,
        paired_ratio,
        prepare,
        quantized_variant,
        rotated,
        target_config,
    )
    from moedeploy.bench.decode import Settings, keeps_extra_buffers, run_in_subprocess
    from moedeploy.bench.machine import cpu_model, measure_bandwidth_gbs
    from moedeploy.bench.peers import gguf_file, missing
    from moedeploy.bench.roofline import decode_step_bytes
    from moedeploy.bench.summary import paired_text
    from moedeploy.compare.quantization import distribution_metrics
    from moedeploy.export.reference import build_decoder
    from moedeploy.models.blockquant import QuantScheme
    from moedeploy.models.config import DecoderConfig

    progress = print
    positions = target_config(args.preset).max_positions  # before any export
    if args.stream > positions:
        raise ValueError(f"--stream {args.stream} exceeds the model's {positions} positions; ask for at most {positions}")
    fp32, _ = prepare(args.preset, [args.backend], 1, 128, 64, progress)
    config = DecoderConfig.from_manifest(fp32.manifest["config"])
    schemes = {"int8": QuantScheme(8, args.block_size), "int4": QuantScheme(4, args.block_size)}
    artifacts = {"fp32": fp32} | {k: quantized_variant(fp32, s, args.preset, progress) for k, s in schemes.items()}
    systems = {f"moedeploy {k}": (a, args.backend, None, None) for k, a in artifacts.items()}
    use_llama = not args.no_llama and missing("llama.cpp") is None
    if not args.no_llama and not use_llama:
        progress(f"llama.cpp left out: {missing('llama.cpp')}")
    if use_llama:
        f32 = gguf_file(fp32, cache_dir() / "bench", progress, checkpoint=args.preset if is_checkpoint(args.preset) else None)
        systems["llama.cpp f32"] = (fp32, "llama.cpp", f32, None)
        for kind, kind_bits, head_bits in LLAMA_FORMATS.values():
            systems[f"llama.cpp {kind}"] = (fp32, "llama.cpp", llama_quantized(f32, kind), (kind_bits, head_bits))
    openvino_absent = missing("openvino") or (None if importlib.util.find_spec("nncf") else
                                              "OpenVINO's int8/int4 need nncf, which is not installed: "
                                              "pip install 'moedeploy[peers]'")
    if not args.no_openvino and openvino_absent:
        progress(f"OpenVINO left out: {openvino_absent}")
    if not args.no_openvino and openvino_absent is None:
        from moedeploy.bench.openvino_peer import compressed_ir

        systems["openvino fp32"] = (fp32, "openvino", None, None)
        for kind, scheme in schemes.items():
            systems[f"openvino {kind}"] = (fp32, "openvino", compressed_ir(fp32, scheme, cache_dir() / "bench", progress),
                                           OPENVINO_BITS[kind])

    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for round_no in range(1, args.rounds + 1):
        for name, (artifact, backend, peer_model, _) in rotated(list(systems.items()), round_no - 1):
            progress(f"timing {name}, round {round_no}/{args.rounds}")
            runs[name].append(run_in_subprocess(Settings(str(artifact.path), backend, 1, 128, 64, args.threads,
                                                         args.repeat, peer_model=str(peer_model) if peer_model else None,
                                                         peer_extra_buffers=keeps_extra_buffers(runs[name]))))
    timed = {name: merge_rounds(r) for name, r in runs.items()}

    progress(f"accuracy on a {args.stream}-token stream against fp32 eager PyTorch")
    stream = torch.randint(0, config.vocab_size, (1, args.stream), generator=torch.Generator().manual_seed(7))
    eager = build_decoder(args.preset, None, fp32.manifest["seed"], torch.float32)
    with torch.no_grad():
        reference = eager(stream, eager.new_cache(1, args.stream), 0)[0].numpy()
    eager_tokens = next((r["tokens"] for n, r in timed.items() if n == "moedeploy fp32" and "error" not in r), None)
    rows = []
    bandwidth = measure_bandwidth_gbs(args.threads)
    context = 128 + 32
    for name, (artifact, backend, peer_model, b) in systems.items():
        r = timed[name]
        if backend == "llama.cpp":  # with its extra buffers only where the timing ran with them
            try:
                logits, note = llama_logits(peer_model, stream, args.threads, r.get("llama_extra_buffers", True))
            except RuntimeError as e:  # its timings stay in the table
                acc = {"accuracy_error": str(e)}
            else:
                acc = distribution_metrics(reference, logits) | ({"note": r["note"]} if "note" in r else note)
        elif backend == "openvino":
            acc = distribution_metrics(reference, openvino_logits(artifact, peer_model, stream, args.threads))
        else:  # at the accuracy level bench times (4: int8 activations), and at 0 (float compute) beside it
            acc = distribution_metrics(reference, ort_logits(artifact, stream, args.threads, 4))
            exact = distribution_metrics(reference, ort_logits(artifact, stream, args.threads, 0))
            acc |= {f"{k}_level0": v for k, v in exact.items()}
        if "error" in r:
            rows.append({"system": name, "error": r["error"], **acc})
            continue
        greedy = float(np.mean(np.array(r["tokens"]) == np.array(eager_tokens))) if eager_tokens else float("nan")
        nbytes = peer_step_bytes(config, context, *b) if b else \
            decode_step_bytes(config, 1, context, 4, artifact.manifest.get("quantization"))
        rows.append({"system": name, "decode_tokens_per_s": r["decode_tokens_per_s"], "prefill_ms": r["prefill_ms"],
                     "decode_all": r["decode_tokens_per_s_all"], "step_mb": nbytes / 1e6,
                     "bound_tokens_per_s": bandwidth * 1e9 / nbytes, "greedy_vs_fp32": greedy, **acc})
    base = {row["system"]: row.get("decode_tokens_per_s") for row in rows}
    print(f"\n{cpu_model()}, {args.threads} threads, {bandwidth:.1f} GB/s; {args.preset} preset, batch 1, prompt 128, "
          f"64 new tokens, {args.rounds} rounds x {args.repeat}; accuracy against fp32 eager on {args.stream} tokens")
    print(f"{'system':20s} {'decode tok/s':>12s} {'x fp32':>7s} {'prefill ms':>10s} {'MB/token':>8s} "
          f"{'KL mean':>9s} {'KL max':>8s} {'top-1':>6s} {'greedy':>6s}  level 0: KL mean, top-1")
    for row in rows:
        if "error" in row:
            print(f"{row['system']:20s} error: {row['error']}")
            continue
        family = row["system"].split()[0]
        own_fp32 = base.get(f"{family} f32" if family == "llama.cpp" else f"{family} fp32")
        accuracy = (f"accuracy: {row['accuracy_error']}" if "accuracy_error" in row else
                    f"{row['kl_mean']:9.5f} {row['kl_max']:8.4f} {row['top1']:6.3f} {row['greedy_vs_fp32']:6.3f}"
                    + (f"  {row['kl_mean_level0']:.5f}, {row['top1_level0']:.3f}" if "kl_mean_level0" in row else ""))
        print(f"{row['system']:20s} {row['decode_tokens_per_s']:12.1f} "
              f"{row['decode_tokens_per_s'] / own_fp32 if own_fp32 else float('nan'):7.2f} "
              f"{row['prefill_ms']:10.1f} {row['step_mb']:8.1f} {accuracy}")
    print_notes(rows)
    for row in rows:
        if "decode_all" in row:
            spread = row["decode_all"]
            print(f"  {row['system']}: decode min / median / max {min(spread):.1f} / {statistics.median(spread):.1f} / "
                  f"{max(spread):.1f} tokens/s")
    # each moedeploy format against its llama.cpp / OpenVINO counterpart, round by round: the
    # figure to read on a machine whose speed drifts over the run
    pairs = {}
    for kind, (llama_kind, *_) in {"fp32": ("f32",), **LLAMA_FORMATS}.items():
        for peer in (f"llama.cpp {llama_kind}", f"openvino {kind}"):
            ours = timed.get(f"moedeploy {kind}")
            if ours and peer in timed and "error" not in ours and "error" not in timed[peer] \
                    and (paired := paired_ratio(ours, timed[peer])):
                pairs[f"moedeploy {kind} / {peer}"] = paired
                print(f"  moedeploy {kind} / {peer}: decode paired by round {paired_text(paired)}")
    write_script_report(args.json, "quantized", {"bandwidth_gbs": bandwidth, "rows": rows, "paired": pairs})


if __name__ == "__main__":
    from moedeploy.bench.report_file import run_script

    run_script(main)
