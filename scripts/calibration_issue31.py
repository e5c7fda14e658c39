"""Issue #31's figures: GPTQ and AWQ calibrated on ~50 prompts against round to nearest, on the bundled model.

    .venv-calibrate/bin/python scripts/calibration_issue31.py --work /tmp/cal31 --out docs/results/quant-calibrated.json

Run from the checkout's root with a virtualenv that has the `calibrate` extra (`pip install -e '.[calibrate]'`,
after `pip install torch==2.13.0`). Every step is the command a user types (recorded in the JSON):

1. `python -m tokenfactory.models.hf_export` writes the bundled GGUF as a float32 Hugging Face folder.
2. `tokenfactory quantize --method gptq|awq --calibration <the bundled SQLite prose> --num-samples 50`: 50 of its
   62 paragraphs calibrate, 12 are held out (heldout.jsonl).
3. `tokenfactory eval --model FOLDER --json`: perplexity on the held-out paragraphs, against the float folder and
   against round to nearest of the same shape with the LM head float as the recipes leave it.
4. Served output tokens/s at 1 and 8 clients (streaming, ignore_eos, 128 tokens, closed loop; bench/plain.py) for
   each folder, for round to nearest written by `tokenfactory quantize --lm-head float` (the same layers
   quantized), and for the bundled GGUF as served by default.

The bundled model's float weights are its Q4_1 blocks dequantized (an asymmetric 4-bit grid in groups of 32), so
groups of 64 are the fair ground (SmolLM2's 576 inputs do not divide into 128): no method starts on its own grid
there. Groups of 32 are measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenfactory.bench.compare import ServerProcess, free_port  # noqa: E402
from tokenfactory.bench.plain import closed_loop, served_model  # noqa: E402

CALIBRATION = ROOT / "tokenfactory" / "quality" / "data" / "sqlite_api_prose.txt"
# (name, quantize arguments)
METHODS: dict[str, list[str]] = {
    "gptq-w4-g64-sym": ["--method", "gptq", "--group-size", "64", "--symmetric"],
    "gptq-w4-g64-asym": ["--method", "gptq", "--group-size", "64", "--no-symmetric"],
    "awq-w4-g64-asym": ["--method", "awq", "--group-size", "64"],
    "gptq-w4-g32-asym": ["--method", "gptq", "--group-size", "32", "--no-symmetric"],
    "awq-w4-g32-asym": ["--method", "awq", "--group-size", "32"],
}
RTN = {"rtn-int4-g64-head-float": "int4-g64", "rtn-int4-g32-head-float": "int4-g32"}
BUNDLED = "bundled-gguf-default"  # `tokenfactory serve` with no flags
PROMPT = ("Write a detailed explanation of how a database keeps its data safe when the power fails in the middle of "
          "a write, covering journals, write-ahead logs and checkpoints. ")


def tf(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenfactory.cli", *args]


def run(cmd: list[str], log: Path, ok: tuple[int, ...] = (0,)) -> tuple[str, float]:
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {log.read_text()[-2000:]}")
    return proc.stdout, time.perf_counter() - start


def display(cmd: list[str]) -> str:
    return " ".join(["tokenfactory", *cmd[3:]] if cmd[2] == "tokenfactory.cli" else ["python", *cmd[1:]])


def served_speed(model_args: list[str], log: Path, prompts: int) -> dict[str, Any]:
    port = free_port()
    cmd = tf("serve", "--port", str(port), "--log-level", "warning", *model_args)
    server = ServerProcess("tokenfactory serve", cmd, log)  # from the checkout's root, as this script runs
    url = f"http://127.0.0.1:{port}"
    try:
        problem = server.wait_ready(url, 600)
        if problem is not None:
            raise RuntimeError(problem)
        model = served_model(url)
        closed_loop(url, model, [PROMPT] * 2, 16, 2)  # warm-up
        out: dict[str, Any] = {"command": display(cmd)}
        for clients in (1, 8):
            r = closed_loop(url, model, [PROMPT] * (prompts * clients), 128, clients)
            if r["errors"] or r["completed"] != prompts * clients:
                raise RuntimeError(f"{clients} clients: {r}")
            out[f"{clients}_clients"] = r | {"load_average_after": round(os.getloadavg()[0], 2)}
        return out
    finally:
        server.stop()


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((x.split(":", 1)[1].strip() for x in lscpu if x.startswith("Model name")), platform.processor())
    family = next((x.split(":", 1)[1].strip() for x in lscpu if x.startswith("CPU family")), None)
    return {"cpu": model, "cpu_family": family, "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()}


def serve_args(name: str, work: Path) -> list[str]:
    if name in METHODS:
        return ["--model", str(work / name)]
    if name in RTN:
        return ["--model", str(work / f"{name}.safetensors")]
    if name == BUNDLED:
        return []
    raise SystemExit(f"unknown run {name!r}")


def prepare(name: str, entry: dict[str, Any], work: Path, float_dir: Path) -> None:
    """The folder (or file) of `name`, and for a calibrated one its eval."""
    if name in METHODS:
        target = work / name
        cmd = tf("quantize", str(float_dir), str(target), "--calibration", str(CALIBRATION), "--num-samples",
                 "50", "--seed", "0", *METHODS[name])
        if not (target / "calibration.json").is_file():
            _, seconds = run(cmd, work / f"{name}.quantize.log")
            entry["quantize"] = {"command": display(cmd), "wall_s": round(seconds, 1),
                                 "load_average_after": round(os.getloadavg()[0], 2)}
        ev = tf("eval", "--model", str(target), "--json")
        out, seconds = run(ev, work / f"{name}.eval.log", ok=(0, 1))  # 1: FAIL, and its JSON says why
        entry["eval"] = json.loads(out) | {"command": display(ev), "wall_s": round(seconds, 1)}
    elif name in RTN:
        target = work / f"{name}.safetensors"
        cmd = tf("quantize", str(float_dir), str(target), "--quantization", RTN[name], "--lm-head", "float",
                 "--force")
        run(cmd, work / f"{name}.quantize.log")
        entry["quantize"] = {"command": display(cmd)}


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key]["output_throughput"] for r in rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="folders and logs (kept: a rerun skips what exists)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default=",".join([*METHODS, *RTN, BUNDLED]), help="comma-separated names")
    p.add_argument("--speed-prompts", type=int, default=6, help="requests per client in each speed run")
    p.add_argument("--speed-rounds", type=int, default=2,
                   help="each round serves every model once, in the reverse order of the round before")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--speed-only", action="store_true", help="keep the folders and evals already in --out")
    args = p.parse_args()
    work, only = args.work.resolve(), args.only.split(",")
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result |= {"machine": machine(), "calibration_file": str(CALIBRATION.relative_to(ROOT)), "runs": result.get(
        "runs", {})}
    float_dir = work / "smollm2-hf"
    if not (float_dir / "config.json").is_file():
        run([sys.executable, "-m", "tokenfactory.models.hf_export", str(float_dir)], work / "export.log")
    for name in only:
        entry = result["runs"].setdefault(name, {})
        if not args.speed_only:
            prepare(name, entry, work, float_dir)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{name}: prepared", file=sys.stderr, flush=True)
    if not args.no_speed:
        for name in only:
            result["runs"][name]["served_rounds"] = []
        for i in range(args.speed_rounds):
            for name in only if i % 2 == 0 else only[::-1]:
                entry = result["runs"][name]
                entry["served_rounds"].append(served_speed(serve_args(name, work), work / f"{name}.serve.log",
                                                           args.speed_prompts))
                entry["served_median_tok_s"] = {f"{c}_clients": median_of(entry["served_rounds"], f"{c}_clients")
                                                for c in (1, 8)}
                entry.pop("served", None)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
                print(f"{name}: round {i + 1} served", file=sys.stderr, flush=True)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
