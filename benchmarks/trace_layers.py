"""Tracing a decoder: every layer traced, against its first layers of each kind traced and the
rest copied (export/stamping.py), in one process, with the two graphs compared.

torch.onnx.export costs a few seconds a layer on a small CPU, the same for a layer of a real
checkpoint as for a tiny one (the graph is traced over empty weights), so a deep model spent
most of its export in the tracer before layers were copied. Both ways run here on the same
config, one after the other, after a warm-up trace; the graphs must hold the same number of nodes and
the same weight recipes.

    python benchmarks/trace_layers.py [--preset small] [--layers 8 32] [--dtype fp32] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from moedeploy.bench.report_file import (
    at_least,
    run_script,
    script_report_check,
    write_script_report,
)

SCRIPT = "trace_layers"


def main() -> None:
    from moedeploy.export.artifact import parse_dtype
    from moedeploy.models.config import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="the layers' shapes (the layer count is --layers)")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32], help="decoder depths to trace")
    parser.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    at_least(parser, args, {"--layers": 2})
    script_report_check(parser, args.json, SCRIPT)
    dtype = parse_dtype(args.dtype)

    from moedeploy.export import stamping, streaming
    from moedeploy.models.decoder import MoEDecoder

    def names_of(config) -> list[str]:
        with torch.device("meta"):
            return list(MoEDecoder(config).state_dict())

    def timed(trace, config) -> tuple[float, streaming.TracedDecoder]:
        start = time.perf_counter()
        traced = trace(config, dtype, names_of(config))
        return time.perf_counter() - start, traced

    base = PRESETS[args.preset]
    timed(streaming._trace_layers, dataclasses.replace(base, n_layers=1))  # imports and first-call costs
    rows = []
    for n in args.layers:
        config = dataclasses.replace(base, n_layers=n)
        prefix = stamping.traced_prefix(stamping.layer_signatures(config))
        full_s, full = timed(streaming._trace_layers, config)
        copied_s, copied = timed(streaming._trace, config)
        same = (len(list(full.model.graph)) == len(list(copied.model.graph)) and full.recipes == copied.recipes
                and [v.name for v in full.model.graph.outputs] == [v.name for v in copied.model.graph.outputs])
        if not same:
            raise ValueError(f"{n} layers: the copied graph differs from the full trace in its nodes, weights "
                             "or outputs")
        rows.append({"layers": n, "traced_layers": prefix or n, "full_trace_s": full_s, "copied_s": copied_s,
                     "speedup": full_s / copied_s, "nodes": len(list(copied.model.graph))})
    print(f"{args.preset} preset's layer shapes, {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'layers':>6} {'traced':>6} {'every layer s':>13} {'copied s':>9} {'speed-up':>8} {'nodes':>6}")
    for r in rows:
        print(f"{r['layers']:>6} {r['traced_layers']:>6} {r['full_trace_s']:>13.1f} {r['copied_s']:>9.1f} "
              f"{r['speedup']:>7.1f}x {r['nodes']:>6}")
    write_script_report(args.json, SCRIPT, {"preset": args.preset, "dtype": args.dtype, "results": rows})


if __name__ == "__main__":
    run_script(main)
