"""`tokenfactory serve`'s flags and what they become: the engine's config, the fleet's specs, the connection
limits, a saved baseline. Light at import (argparse only): the engine is imported where a flag is turned into
its config, not when the command registers."""

from __future__ import annotations

import argparse

from tokenfactory.config import dense_path
from tokenfactory.levers import parse_memory  # --kv-cache-memory's type, shared with doctor (#30)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import add_lever, engine_default  # one name, default and why per lever (#30)

    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    p.add_argument("--device", default=engine_default("device"),
                   help="cpu or cuda[:N]: where the weights, the KV cache and every step live")
    add_lever(p, "dtype", aliases=False, default=engine_default("dtype"),
              choices=["auto", "float32", "bfloat16", "float16"])
    add_lever(p, "max_model_len", aliases=False, type=int, default=engine_default("max_model_len"))
    add_lever(p, "max_num_seqs", aliases=False, type=int, default=engine_default("max_num_seqs"))
    add_lever(p, "max_num_batched_tokens", aliases=False, type=int, default=engine_default("max_num_batched_tokens"))
    add_lever(p, "block_size", aliases=False, type=int, default=engine_default("block_size"))
    p.add_argument("--kv-cache-memory", type=parse_memory, default=engine_default("kv_cache_memory"),
                   help="KV cache size: bytes (2GiB) or a fraction of the memory free once the weights are placed "
                        "(0.5). Default: 85%% of it on CUDA; 30%% on a CPU, at most 1 GiB (a CPU server shares its "
                        "RAM)")
    add_lever(p, "kv_cache_dtype", aliases=False, default=engine_default("kv_cache_dtype"),
              choices=["auto", "int8", "fp8"], extra="docs/memory.md")
    add_lever(p, "no_prefix_caching", aliases=False, action="store_true")
    p.add_argument("--batch-share", type=float, default=engine_default("batch_min_share"),
                   help="of --max-num-seqs, the share of seats kept for batch jobs while they have work, so a busy "
                        "server still finishes them; the rest they fill only when idle (docs/batch.md)")
    p.add_argument("--batch-yield", default=engine_default("batch_yield"), choices=["share", "seats"],
                   help="how far batch jobs give way to other traffic: share (down to --batch-share while it is "
                        "present: the default, right where compute is short) or seats (only the seats it needs)")
    add_lever(p, "quantization", aliases=False, default=engine_default("quantization"))
    p.add_argument("--quantization-dense", default="auto", choices=["auto", "prepacked", "copy", "on-the-fly"],
                   help="quantized layers' large steps: copy (keep a dequantized copy: fast batches, more memory), "
                        "prepacked (on a CPU in bf16 also oneDNN's own copy of it for steps of up to 256 rows: "
                        "faster decode batches, a second copy's memory), on-the-fly (the packed codes only, "
                        "dequantized per large step), or auto: on a CPU the first of prepacked, copy, on-the-fly "
                        "that fits; on CUDA on-the-fly whenever the copy would make the weights bigger than not "
                        "quantizing them (int4 with a bf16 copy is more than bf16 alone)")
    p.add_argument("--seed", type=int, default=engine_default("seed"),
                   help="the sampling seed of requests that give none, so a server's answers can be reproduced")
    p.add_argument("--single-thread-step-tokens", type=int, default=None,
                   help="run steps of at most this many tokens on one CPU thread (0: off; default: what the machine "
                        "profile measured, see --machine-profile and docs/benchmarks.md)")
    p.add_argument("--machine-profile", default="auto", choices=["auto", "remeasure", "off"],
                   help="CPU kernel crossovers and the small-step thread policy, measured for this CPU and model: "
                        "auto (cached, measured at the first start, ~5 s), remeasure, or off (built-in constants); "
                        "`tokenfactory doctor --machine` prints it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the engine's kernels (default: PyTorch's, one per core). On a machine "
                        "whose cores are also busy with other work, fewer threads avoid OpenMP's spin-wait collapse")
    p.add_argument("--speculative", default="none",
                   help="speculative decoding: none, ngram, draft:PATH or self-int4 (docs/speculative.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=engine_default("num_speculative_tokens"),
                   help="most draft tokens per sequence and step: more pays when drafts are accepted, costs compute "
                        "when they are not")
    p.add_argument("--pooling", default=engine_default("pooling"), choices=["auto", "last", "mean"],
                   help="/v1/embeddings' pooling of the final hidden states: auto (the model's own setting, from its "
                        "sentence-transformers folder or GGUF metadata, else the last token), last or mean")
    p.add_argument("--decode-step", default=engine_default("decode_step"), choices=["auto", "eager", "cuda-graphs"],
                   help="how a decode-only step runs: auto (on the CPU the decoder layers in one fused C++ call; on "
                        "CUDA torch.compile's CUDA graphs, one per batch-size bucket, compiled at start-up), eager "
                        "(the model's Python forward every step, as vLLM's --enforce-eager), or cuda-graphs")
    p.add_argument("--scheduling-policy", default=None,
                   help="waiting-queue order: fcfs, vtc (priority bands + weighted fair share in tokens) or "
                        "vtc-joules (the same, counted in measured joules); default vtc with --auth (the "
                        "tenants' priorities and weights apply), else fcfs; see docs/tenants.md")


def engine_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig (imported lazily)
    from tokenfactory.config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        batch_min_share=getattr(args, "batch_share", 0.1),
                        batch_yield=getattr(args, "batch_yield", "share"),
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                        quantization_dense=dense_path(getattr(args, "quantization_dense", "copy")),
                        quantization=args.quantization,
                        single_thread_step_tokens=getattr(args, "single_thread_step_tokens", None),
                        machine_profile=getattr(args, "machine_profile", "auto"),
                        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                        pooling=getattr(args, "pooling", "auto"), scheduling_policy=scheduling_policy(args),
                        decode_step=getattr(args, "decode_step", "auto"))


def scheduling_policy(args: argparse.Namespace) -> str:
    """The flag's, or the default: with --auth the tenants' priorities and weights apply (vtc)."""
    chosen = getattr(args, "scheduling_policy", None)
    if chosen:
        return chosen
    return "vtc" if getattr(args, "auth", False) else "fcfs"


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """Replicas behind the gateway (docs/fleet.md)."""
    from tokenfactory.fleet.router import ROUTERS

    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas of the model: 1 runs it in this process; N > 1 starts N local processes "
                        "(or Ray actors with --ray), each with its share of the cores; 0 with --backend only")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place the replicas as Ray actors: on a local Ray bound to 127.0.0.1 only (no ADDRESS), or "
                        "on the cluster at ADDRESS, joined with its auth token from RAY_AUTH_TOKEN or a file "
                        "(RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), never a flag (docs/fleet.md)")
    g.add_argument("--ray-placement", default="spread", choices=["spread", "pack"],
                   help="Ray replicas across nodes: spread (Ray's SPREAD: different nodes while there are some) or "
                        "pack (onto the node holding most of the model's replicas while it has room)")
    g.add_argument("--ray-resource", action="append", default=[], metavar="NAME[=AMOUNT]",
                   help="a custom Ray node resource each replica needs (repeatable; AMOUNT default 0.001): keeps "
                        "the replicas on the nodes started with `ray start --resources '{\"NAME\": 1}'`")
    g.add_argument("--replica-power-source", default="auto", choices=["auto", "nvml", "rapl", "modelled"],
                   help="what each Ray replica meters on its own node: auto (NVML for its GPU, else the modelled "
                        "source for its share of the node's CPUs), or rapl (the whole CPU package: one replica "
                        "per node only)")
    g.add_argument("--backend", action="append", type=_backend_spec, default=[], metavar="URL[,model=..]",
                   help="an external OpenAI-compatible server as a replica (repeatable): "
                        "URL[,model=ITS_NAME][,served=OUR_NAME][,device=CATALOG_DEVICE][,key=API_KEY][,tokenizer=PATH]"
                        "; it joins --model's replicas, or with tokenizer= (a model no replica here runs) serves "
                        "`served` (default: `model`) on its own")
    g.add_argument("--fleet-model", action="append", type=_model_spec, default=[], metavar="PATH[,name=..]",
                   help="another model served beside --model by its own local replicas (repeatable): "
                        "PATH[,name=SERVED_NAME][,replicas=N]; requests go to the model their `model` names")
    g.add_argument("--router", default="least-work", choices=sorted(ROUTERS),
                   help="routing policy: least-work (outstanding tokens), prefix (prefix affinity, load "
                        "fallback) or energy (lowest marginal joules per token within a TTFT bound)")
    g.add_argument("--sticky-sessions", action="store_true", help="keep a request's `user` on one replica")
    g.add_argument("--replica-timeout", type=float, default=10.0,
                   help="seconds a replica may stay silent before it counts as hung and is restarted")
    from tokenfactory.serve.autoscale import add_autoscaler_args  # docs/autoscaling.md

    add_autoscaler_args(p.add_argument_group("autoscaling"))


def _backend_spec(text: str):  # noqa: ANN202 - BackendSpec
    from tokenfactory.fleet.launch import BackendSpec

    try:
        return BackendSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _model_spec(text: str):  # noqa: ANN202 - ModelSpec
    from tokenfactory.fleet.launch import ModelSpec

    try:
        return ModelSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def fleet_mode(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", 1) != 1 or getattr(args, "ray", None) is not None or bool(
        getattr(args, "autoscaler", None)) or bool(getattr(args, "backend", [])) or bool(
        getattr(args, "fleet_model", []))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Connection limits and timeouts (docs/server.md, "Limits"); defaults are LimitSettings'."""
    g = p.add_argument_group("limits")
    g.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections or running requests beyond this get 503 (0: no limit)")
    g.add_argument("--backlog", type=int, default=2048, help="connections the kernel queues before accept()")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from a request head's first byte (or the connection's opening) to its end; "
                        "past it the connection is closed (slowloris)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds from the end of a request head to the end of its body; past it, 408")
    g.add_argument("--max-header-bytes", type=parse_memory, default=16 << 10,
                   help="request line and headers beyond this size get 431")
    g.add_argument("--send-buffer", type=parse_memory, default=256 << 10,
                   help="the kernel's send buffer per connection (SO_SNDBUF): what a client that stops reading "
                        "can hold of the server's memory before --stream-send-timeout counts")


def batch_settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - BatchSettings (imports the gateway)
    from tokenfactory.batch.runner import BatchSettings

    return BatchSettings(max_lines_in_flight=args.batch_lines_in_flight,
                         max_lines_in_flight_per_tenant=args.batch_lines_per_tenant,
                         max_active_jobs_per_tenant=args.batch_jobs_per_tenant,
                         max_bytes_per_tenant=int(args.batch_storage_per_tenant), stop_grace_s=args.batch_stop_grace,
                         cancel_grace_s=args.batch_cancel_grace, prices_path=args.prices)


def responses_settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - ResponsesSettings (imports the gateway)
    from tokenfactory.responses.routes import ResponsesSettings

    return ResponsesSettings(retention_s=max(1, round(args.responses_retention_days * 86_400)),
                             send_timeout_s=args.stream_send_timeout)


def limit_settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - LimitSettings (imports uvicorn)
    from tokenfactory.gateway.limits import LimitSettings

    return LimitSettings(limit_concurrency=args.limit_concurrency or None, backlog=args.backlog,
                         timeout_keep_alive_s=args.timeout_keep_alive, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, max_header_bytes=int(args.max_header_bytes),
                         send_buffer_bytes=int(args.send_buffer))


def read_baseline(path: str) -> tuple[str, float]:
    """(run name, J per output token) of a saved bench result; ValueError naming what is missing."""
    import json
    from pathlib import Path

    try:
        figures = json.loads(Path(path).read_text()).get("figures") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--baseline {path}: cannot read a bench result ({e})") from e
    value = figures.get("joules_per_output_token")
    if not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"--baseline {path}: the run has no joules_per_output_token figure (it measured no energy)")
    return Path(path).stem, float(value)
