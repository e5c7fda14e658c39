"""`serve --profile latency|throughput|efficiency`: engine limits, chunk size, speculation, SLO targets and the
autoscaler's goal from the planner's model of the machine (planner/scenarios.py says what each one sets and why).

The machine is the catalog device `--profile-device` names (default: the catalog's CPU for a CPU server, the
first catalog GPU whose name the CUDA device's contains, else H100-SXM); the model is the served file. A flag
the user gave explicitly wins over the profile (a flag still at its parser default is the profile's to set).
"""

from __future__ import annotations

import argparse
from pathlib import Path

PROFILE_FLAGS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                 "speculative": "speculative", "ttft_slo": "ttft_slo_s", "tpot_slo": "tpot_slo_s"}


def add_profile_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.planner.scenarios import PROFILES

    g = p.add_argument_group("scenario profile (docs/autoscaling.md)")
    g.add_argument("--profile", choices=PROFILES,
                   help="latency (small batches, short chunks, speculation), throughput (largest batches) or "
                        "efficiency (fewest joules per token, the energy autoscaler), from the planner's model")
    g.add_argument("--profile-device", help="the catalog device that models this machine for --profile")


def _device(args: argparse.Namespace, catalog: object) -> str:
    if args.profile_device:
        return args.profile_device
    names = catalog.device_names()  # type: ignore[attr-defined]
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        return next((n for n in names if n.lower().startswith("cpu")), names[0])
    import torch  # a CUDA server has torch: its device's marketing name picks the catalog entry

    gpu = torch.cuda.get_device_name().lower()
    return next((n for n in names if n.split("-")[0].lower() in gpu), "H100-SXM")


def apply_profile(args: argparse.Namespace, parser_defaults: dict[str, object]
                  ) -> tuple[argparse.Namespace, str | None]:
    """The flags with the profile's values where the user left the default (`parser_defaults`: what the parser
    gives when no flag is given), as a new namespace (the user's is not written to), and the banner line."""
    if not getattr(args, "profile", None):
        return args, None
    from tokenfactory.models.loader import bundled_model_path
    from tokenfactory.planner.catalog import load_catalog
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.memory import plan_memory, resolve_weights
    from tokenfactory.planner.modelsrc import load_model
    from tokenfactory.planner.perf import StepModel, Workload
    from tokenfactory.planner.precision import parse_kv_dtype
    from tokenfactory.planner.scenarios import make_profile

    catalog = load_catalog()
    device = catalog.device(_device(args, catalog))
    model = load_model(str(Path(args.model) if getattr(args, "model", None) else bundled_model_path()), catalog)
    hw = hardware_from_catalog(catalog, device)
    weights = resolve_weights(model, None)
    kv = parse_kv_dtype("auto", weights.precision)
    workload = Workload()
    # The largest profile's batch and chunk size the activations; max_model_len as serve resolves it (#30).
    memory = plan_memory(hw, model, weights, kv, getattr(args, "max_model_len", None), 256, 8192)
    profile = make_profile(args.profile, StepModel(hw, model, weights, kv), workload,
                           memory.max_seqs(workload.prompt_tokens + workload.output_tokens),
                           f"modelled on {device.name}")
    chosen = {flag: getattr(profile, field) for flag, field in PROFILE_FLAGS.items()
              if hasattr(args, flag) and getattr(args, flag) == parser_defaults.get(flag)}
    if getattr(args, "autoscaler", None) == "auto":
        chosen["autoscaler"] = profile.autoscaler
    line = f"{profile.describe()} ({profile.reason}; flags you gave win)"
    return argparse.Namespace(**{**vars(args), **chosen}), line
