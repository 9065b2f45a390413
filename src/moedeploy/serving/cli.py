"""`moedeploy serve` and `moedeploy triton-repo`: thin commands over moedeploy.serving.

`register(app)` adds them to the `moedeploy` Typer app; the CLI helpers are imported inside
it, because moedeploy.cli imports this module.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the serving commands to `app`."""
    from rich.markup import escape

    from moedeploy.cli import (
        UserError,
        check_artifact_folder,
        check_writable,
        err,
        given,
        handle_errors,
        make_table,
        out,
    )

    @app.command("serve")
    @handle_errors
    def serve_cmd(
        artifacts: list[Path] = typer.Argument(..., help="Artifact folder(s) made by `moedeploy export`; one Triton server serves them all.", show_default=False),
        backend: str = typer.Option("ort", "--backend", help="Runner behind every model: ort, trt or torch (eager PyTorch)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address every endpoint binds to (0.0.0.0 to serve beyond this machine)."),
        http_port: int = typer.Option(8000, "--http-port", help="KServe v2 HTTP/REST port (also /v2/health/live and /v2/health/ready); moedeploy's front listens here, Triton on a private loopback port behind it."),
        grpc_port: int = typer.Option(8001, "--grpc-port", help="KServe v2 gRPC port (moedeploy's front, like --http-port)."),
        metrics_port: int = typer.Option(8002, "--metrics-port", help="Prometheus metrics port (/metrics)."),
        max_batch_size: int = typer.Option(None, "--max-batch-size", min=1, help="Largest batch one execution takes (default: the artifact's batch range max)."),
        max_queue_delay_us: int = typer.Option(100, "--max-queue-delay-us", min=0, help="How long the dynamic batcher may hold a request to grow a batch."),
        dynamic_batching: bool = typer.Option(True, "--dynamic-batching/--no-dynamic-batching", help="Let Triton merge concurrent requests into one execution."),
        instances: int = typer.Option(1, "--instances", min=1, help="Model instances (each with its own runner) per model."),
        exit_timeout: int = typer.Option(5, "--exit-timeout", help="Seconds shutdown waits for in-flight requests."),
        max_request_mb: float = typer.Option(64.0, "--max-request-mb", help="Largest request (MiB): an HTTP body or gRPC message over it is refused (HTTP 413, gRPC RESOURCE_EXHAUSTED) before Triton reads it; tensors holding more are refused (400) too. Shapes are also held to the artifact's dynamic ranges."),
        openai_port: int = typer.Option(None, "--openai-port", help="Also serve the OpenAI-compatible API on this port: /v1/models, /v1/completions, /v1/chat/completions (with stream), for every decoder exported with its tokenizer; it forwards to the Triton models. A request without max_tokens gets 16 tokens (completions, OpenAI's default) or 32 (chat)."),
        max_sequences: int = typer.Option(32, "--max-sequences", help="In-flight batching: the most generations a decoder's stream model runs at once, sharing each decode step (ONNX Runtime, attention on GroupQueryAttention)."),
        max_queued: int = typer.Option(128, "--max-queued", help="In-flight batching: the most stream requests that wait for a free sequence; beyond it a request is answered busy (HTTP 503, gRPC UNAVAILABLE)."),
        max_context: int = typer.Option(4096, "--max-context", help="In-flight batching: positions (prompt + max_tokens) each sequence may reach, at most the model's max_positions; its KV cache is preallocated with twice that per row (room for a joining prompt's padded chunk) and touched as it fills."),
        prefill_chunk: int = typer.Option(32, "--prefill-chunk",  # serving.inflight.DEFAULT_PREFILL_CHUNK (a test holds them equal)
            help="In-flight batching: the most tokens of a prompt one step prefills while sequences decode (chunked prefill, as vLLM and TensorRT-LLM do), so the decoding streams wait for a chunk, not a whole prompt; a prompt's first token comes after its last chunk. Applies while the decoding sequences are at least as many as the prompts being prefilled (else whole prompts go in one step). 0: whole prompts always. Measured in benchmarks/README.md: higher decode tokens/s at 16 streams, a later first token."),
        stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per streamed response after the first, which always goes alone (vLLM's --stream-interval). 1 sends each token as it is made; 4 or 8 cut the per-response cost (PyTriton, Triton, gRPC/HTTP) at many concurrent streams, for less smooth streaming. A stream that falls behind gets what is waiting in one response at any setting."),
        packed_weights: str = typer.Option("stream", "--packed-weights", help="ONNX Runtime: which of a decoder's sessions repack the weights into a faster copy of their own. stream: one copy, for the session that serves streams and the OpenAI API; the logits model (and the generate model beside in-flight batching) share the artifact's memory-mapped file (one copy for all of them, decoding about a sixth slower). all: every model and instance keeps its own copy (memory: the weights once per session). A quantized decoder's mapped sessions compute in float and 20-30x slower (ONNX Runtime's int8/int4 kernels want their packed layout), so its generate model repacks at either setting; only its logits model is mapped (a warning says so)."),
        accuracy_level: int = typer.Option(4, "--accuracy-level",  # runtime.quantized.RUN_ACCURACY (a test holds them equal; importing it here would load torch for --help)
            help="ONNX Runtime, quantized artifacts (export --quantize): 4 (the default) multiplies by the int8/int4 weights with int8 activations, as llama.cpp's q8_0/q4_0 do; 0 computes the dequantized products in float, what `moedeploy compare` checks elementwise, at a fraction of the speed (an int8 artifact decodes one sequence about 30x slower). Sessions over the memory-mapped weights (see --packed-weights) compute in float at either level. No effect on float artifacts."),
        log_file: Path = typer.Option(None, "--log-file", help="Write Triton's complete log here instead of the console (which hides a few known-harmless lines, see moedeploy.serving.triton_output)."),
    ) -> None:
        """Serve artifacts on Triton Inference Server.

        KServe v2 over HTTP and gRPC, dynamic batching, health, Prometheus metrics. Model names are the artifacts' manifest names, input and output names the artifacts'.
        A decoder is served three times: <name> (logits; leave out past_key_values.* for
        the prefill), <name>_generate (input_ids -> output_ids, the prompt and
        its continuation; optional max_new_tokens, temperature, top_k, top_p, seed,
        eos_token_id: one value per request, sent with shape [batch, 1] and the same value
        in every row; a request whose rows differ is refused) and <name>_stream (decoupled:
        text_input or input_ids in, a response per new token (or per --stream-interval
        tokens) with output_ids and their text_output; optional max_tokens, temperature, top_k, top_p, seed; over gRPC
        streaming or POST /v2/models/<name>_stream/generate_stream, server-sent events; text
        needs an artifact exported from a checkpoint with its tokenizer, and generation stops
        at the checkpoint's EOS ids; on ONNX Runtime concurrent streams, and the greedy or
        single-row requests of <name>_generate, are batched in flight, joining and leaving
        between decode steps). A bad request gets HTTP 400 /
        gRPC INVALID_ARGUMENT with its reason and fails alone. A generation stops at its next
        token when its HTTP client disconnects or its gRPC client cancels. Runs until SIGINT or SIGTERM.

        \b
        Example:
          moedeploy serve artifacts/moe artifacts/decoder --max-batch-size 8
        """
        for artifact in artifacts:  # a mistyped path is refused before the server's imports (torch, ONNX)
            check_artifact_folder(artifact)
        from moedeploy.serving import ModelServer, ServeOptions, ServingUnavailable, wait_for_signal

        options = ServeOptions(
            backend=backend, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
            max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us, dynamic_batching=dynamic_batching,
            instances=instances, exit_timeout_s=exit_timeout, max_request_mb=max_request_mb, log_file=log_file,
            openai_port=openai_port, max_sequences=max_sequences, max_queued=max_queued, max_context=max_context,
            stream_interval=stream_interval, packed_weights=packed_weights, accuracy_level=accuracy_level,
            prefill_chunk=prefill_chunk,
        )
        if log_file is not None:
            check_writable(log_file.parent, "--log-file")
            log_file.parent.mkdir(parents=True, exist_ok=True)
        server = ModelServer(artifacts, options)
        with err.status(f"starting Triton Inference Server ({backend})", spinner="dots"):
            try:
                server.start()
            except ServingUnavailable as e:  # a missing optional dependency: one line, like the rest
                raise UserError(str(e)) from None
        try:
            table = make_table("models", ["model", "inputs", "outputs", "max batch"], text=("model", "inputs", "outputs"))
            for _, spec in server.specs:
                def names(tensors):
                    return ", ".join(t.name + ("?" if t.optional else "") for t in tensors)

                table.add_row(spec.name, escape(names(spec.inputs)), escape(names(spec.outputs)), str(spec.max_batch_size))
            out.print(table)
            batching = f"dynamic batching, delay {max_queue_delay_us} us" if dynamic_batching else "no dynamic batching"
            out.print(f"[green]serving[/green] HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}  "
                      f"({backend}, {instances} instance(s) per model, {batching}; ? = optional input)", highlight=False)
            if server.openai_url:
                models = ", ".join(m.name for m in server.openai_models)
                out.print(f"[green]OpenAI API[/green] {server.openai_url} (models: {models})", highlight=False)
            out.print("[dim]Ctrl-C or SIGTERM stops it[/dim]")
            received = wait_for_signal(server)
        finally:
            with err.status("stopping", spinner="dots"):
                server.stop()
        out.print(f"stopped ({received})", highlight=False)

    @app.command("triton-repo")
    @handle_errors
    def triton_repo_cmd(
        ctx: typer.Context,
        artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
        out_dir: Path = typer.Option(None, "--out", "-o", help="Model repository folder; <out>/<name>/ is (re)written, other models stay."),
        backend: str = typer.Option("onnxruntime", "--backend", help="Triton backend: onnxruntime (model.onnx) or tensorrt (an AOT plan)."),
        max_batch_size: int = typer.Option(None, "--max-batch-size", min=1, help="Largest batch one execution takes (default: the artifact's batch max)."),
        max_queue_delay_us: int = typer.Option(100, "--max-queue-delay-us", min=0, help="How long the dynamic batcher may hold a request to grow a batch."),
        dynamic_batching: bool = typer.Option(True, "--dynamic-batching/--no-dynamic-batching", help="Write a dynamic_batching block."),
        instances: int = typer.Option(1, "--instances", min=1, help="Instances in the instance group."),
        kind: str = typer.Option("auto", "--kind", help="Instance kind: auto, cpu or gpu (TensorRT: always gpu)."),
        engine: Path = typer.Option(None, "--engine", help="The plan to deploy when <artifact>/engines holds several."),
        plugin_lib: list[Path] = typer.Option(None, "--plugin-lib", help="Extra TensorRT plugin library to ship and load (repeatable); AOT plans need none."),
        force: bool = typer.Option(False, "--force", help="Replace <out>/<name>/ even when moedeploy did not write it."),
    ) -> None:
        """Write a model repository for a standalone Triton.

        <out>/<name>/ gets config.pbtxt, the version folder and the model file. The config declares the artifact's inputs and outputs (dims without the batch dim),
        max_batch_size, dynamic batching and the instance group. Start Triton with the printed
        command. The decoder's generation loop is Python and is not part of it (`moedeploy serve` runs it).
        """
        check_artifact_folder(artifact)
        from moedeploy.serving.repository import RepositoryOptions, write_repository

        if out_dir is None:
            raise UserError("missing --out DIR: the model repository folder to write")
        if not dynamic_batching and given(ctx, "max_queue_delay_us"):
            raise UserError("--max-queue-delay-us is the dynamic batcher's; with --no-dynamic-batching it would be "
                            "ignored, so drop one of them")
        check_writable(out_dir)
        options = RepositoryOptions(
            backend=backend, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
            dynamic_batching=dynamic_batching, instances=instances, kind=kind, engine=engine,
            plugin_libs=list(plugin_lib or []),
        )
        result = write_repository(artifact, out_dir, options, force=force)
        out.print(f"[green]wrote[/green] {result.model_dir} ({result.config.name}, {result.model_file.relative_to(result.model_dir)})", highlight=False)
        out.print(f"start it with: {escape(result.launch)}", highlight=False, soft_wrap=True)  # one line to copy
