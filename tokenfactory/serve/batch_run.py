"""`tokenfactory batch run IN.jsonl --out OUT.jsonl`: an OpenAI Batch API file run offline, no server.

The engine runs in this process, and the lines go through the same path as a server's batch job (the
request service and `BatchRunner` of batch/runner.py, over an in-process engine client instead of HTTP):
the same validation, the same ledger rows (one per line, in --data-dir), the same output and error
lines. The job's id is derived from the input file's path and bytes, so running the same command again
after an interruption (Ctrl-C, a kill) resumes it: finished lines are not run, nor billed, again.
Light at import: the engine and the gateway are imported inside `run`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from tokenfactory.config import OFFLINE_BATCHING
from tokenfactory.serve.flags import add_engine_args

DEFAULT_ENDPOINT = "/v1/chat/completions"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("batch", help="OpenAI Batch API files, offline")
    sub = p.add_subparsers(dest="batch_command", metavar="COMMAND")
    r = sub.add_parser("run", help="run a Batch API input file through the engine (no server), resumable")
    r.add_argument("input", help="JSONL: one {custom_id, method, url, body} request per line")
    r.add_argument("--out", required=True, help="the output file (successful lines, OpenAI's output shape)")
    r.add_argument("--errors", default=None, help="the error file (default: OUT with .errors.jsonl)")
    r.add_argument("--endpoint", default=None, choices=["/v1/chat/completions", "/v1/completions"],
                   help="the lines' url (default: the first line's)")
    r.add_argument("--max-lines-in-flight", type=int, default=OFFLINE_BATCHING["max_num_seqs"],
                   help="lines in the engine at once: as many as the offline batching's sequences (no server "
                        "waits here, so --max-num-seqs and --max-num-batched-tokens default to the offline LLM "
                        "class's too)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (a line at the end only)")
    add_engine_args(r)
    # No server, so nobody waits on a step: the offline API's batching (config.OFFLINE_BATCHING), not serve's. On
    # 128 lines of bench offline's workload: 37.1-37.8 device-s and 216-222 J against 43.5-43.7 and 265-266.
    r.set_defaults(**OFFLINE_BATCHING)
    r.add_argument("--data-dir", default=None, help="where the ledger and the job's state live")
    r.add_argument("--database-url", default=None, help="a SQLAlchemy URL instead of SQLite in --data-dir")
    r.add_argument("--power-source", default="auto", help="auto, nvml, rapl, modelled, constant")
    r.add_argument("--power-watts", type=float, default=None, help="watts for --power-source constant")
    r.add_argument("--cpu-tdp-watts", type=float, default=None, help="TDP for the modelled source")
    r.add_argument("--prices", default=None, help="a prices TOML file merged over the dated defaults")
    r.add_argument("--device-profile", default=None, help="the prices file's device profile (default: matched)")
    r.add_argument("--served-model-name", default=None, help="the model name lines may give")
    r.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def first_url(content: bytes) -> str:
    for text in content.decode("utf-8", errors="replace").split("\n"):  # JSONL: \n only, as the runner splits
        try:
            url = json.loads(text).get("url")
        except (ValueError, AttributeError):
            continue
        if isinstance(url, str):
            return url
    return DEFAULT_ENDPOINT


def job_ids(path: Path, content: bytes) -> tuple[str, str]:
    """(file id, batch id) from the file's absolute path and bytes: the same command resumes the same job."""
    digest = hashlib.sha256(str(path.resolve()).encode() + b"\0" + content).hexdigest()[:24]
    return f"file-{digest}", f"batch_{digest}"


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tokenfactory.models.loader import served_name
    from tokenfactory.serve.engine import launch_checked

    source = Path(args.input)
    content = source.read_bytes()  # FileNotFoundError: the cli's "error: ..." and status 2
    endpoint = args.endpoint or first_url(content)
    if endpoint not in ("/v1/chat/completions", "/v1/completions"):
        raise ValueError(f"the lines' url is {endpoint!r}; batch run takes /v1/chat/completions or /v1/completions")
    engine, loaded, (accounting, power, _) = launch_checked(args)
    name = served_name(str(loaded.path), args.served_model_name)
    try:
        totals = asyncio.run(_run_job(args, engine, accounting, name, source, content, endpoint))
    finally:
        engine.shutdown()
        accounting.meter.close()
        accounting.close()
    print(totals, file=sys.stderr)
    return 0


async def _run_job(args: argparse.Namespace, engine, accounting, name: str, source: Path,  # noqa: ANN001
                   content: bytes, endpoint: str) -> str:
    import asyncio

    from tokenfactory.batch.routes import data_dir_of
    from tokenfactory.batch.runner import BatchRunner, BatchSettings
    from tokenfactory.batch.store import BatchStore
    from tokenfactory.service.admission import Admission
    from tokenfactory.service.call import ANONYMOUS_PRINCIPAL
    from tokenfactory.service.service import RequestService
    from tokenfactory.service.tenancy import Tenancy

    tenancy = Tenancy(None, Admission(accounting.ledger, max_waiting=max(256, 2 * args.max_lines_in_flight)))
    service = RequestService({name: engine}, accounting, tenancy)
    data_dir = data_dir_of(service)
    assert data_dir is not None
    store = BatchStore(accounting.ledger.engine, data_dir)
    batch_id = await asyncio.to_thread(_ensure_job, store, source, content, endpoint)
    runner = BatchRunner(service, store, BatchSettings(max_lines_in_flight=args.max_lines_in_flight,
                                                       prices_path=args.prices), lambda _tenant: ANONYMOUS_PRINCIPAL)
    if store.get_job(batch_id)["status"] in ("validating", "in_progress", "finalizing", "cancelling"):
        runner.submit(batch_id)
        await _progress(runner, store, batch_id, quiet=args.no_progress)
    await service.drain()
    return await asyncio.to_thread(_write_files, store, batch_id, Path(args.out), args.errors, args.prices)


def _ensure_job(store, source: Path, content: bytes, endpoint: str) -> str:  # noqa: ANN001 - BatchStore
    file_id, batch_id = job_ids(source, content)
    if store.get_job(batch_id) is not None:
        return batch_id  # an earlier run of the same file: resumed (or already finished)
    store.add_file(content, source.name, "batch", "anonymous", file_id=file_id)
    now = int(time.time())
    store.add_job({"batch_id": batch_id, "tenant": "anonymous", "endpoint": endpoint, "input_file_id": file_id,
                   "completion_window": "24h", "status": "validating", "created_at": now,
                   "expires_at": now + 365 * 86_400})  # offline: no window to miss
    return batch_id


async def _progress(runner, store, batch_id: str, quiet: bool) -> None:  # noqa: ANN001
    """A progress bar over the job's lines (counted from the store) until the runner is done."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    task = runner.tasks[batch_id]
    with Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[errors]} errors"),
                  TimeRemainingColumn(), disable=quiet, transient=False) as bar:
        row = bar.add_task("lines", total=None, errors=0)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            t = await asyncio.to_thread(store.totals, batch_id)
            bar.update(row, total=t.num_total or None, completed=t.num_done + t.num_error, errors=t.num_error)
    task.result()


def _write_files(store, batch_id: str, out: Path, errors: str | None,  # noqa: ANN001 - BatchStore
                 prices_path: str | None) -> str:
    """OUT and the error file from the store; returns the summary line."""
    from tokenfactory.batch.runner import batch_price_multiplier

    job, t = store.get_job(batch_id), store.totals(batch_id)
    done, failed = store.results(batch_id, "done"), store.results(batch_id, "error")
    out.write_text("".join(json.dumps(line) + "\n" for line in done))
    error_path = Path(errors) if errors else out.with_suffix(".errors.jsonl")
    if failed:
        error_path.write_text("".join(json.dumps(line) + "\n" for line in failed))
    multiplier, _ = batch_price_multiplier(prices_path)
    energy = f"{t.energy_joules:.1f} J ({'+'.join(t.energy_sources)})" if t.energy_joules is not None else "energy n/a"
    cost = (f"{t.cost_usd:.6f} USD interactive, {t.cost_usd * multiplier:.6f} USD at the batch price"
            if t.cost_usd is not None else "cost n/a")
    return (f"{batch_id} {job['status']}: {t.num_done} done, {t.num_error} errors, {t.num_pending} not run -> {out}"
            f"{f' and {error_path}' if failed else ''}; {t.prompt_tokens} prompt + {t.completion_tokens} "
            f"completion tokens, {energy}, {t.device_seconds:.2f} device-s, {cost}")
