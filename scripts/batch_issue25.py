"""Issue #25's quantitative cases on a real `tokenfactory serve --auth` (the bundled SmolLM2), for any checkout:

    PYTHONPATH=CHECKOUT TOKENFACTORY_KERNEL_CACHE=/tmp/kc-X python scripts/batch_issue25.py --label after \
        --out docs/results/batch-issue25-after.json [--cases 1,2,3,5,7]

The server is the checkout on PYTHONPATH (`python -m tokenfactory.cli serve`), so the same script measures the
code before the fixes and after. Only the HTTP API, the ledger's SQLite file and /proc are read, so nothing here
depends on either checkout's internals (tenants are made with TenantStore, whose API both share).

1. restart billing: a job SIGTERMed with lines in flight, restarted: the ledger's output tokens vs the job's.
2. the stall: /health's latency while 10,000 distinct + 10,000 repeated custom_ids are validated.
3. a rate-limited tenant (rpm=1, 40 lines): how long another tenant's one-line job takes.
5. a cancelled job: the ledger's output tokens vs what the job reports (Batch usage, output and error files).
7. server RSS per queued 50,000-line job, and after cancelling it.

and, as probes (one request each, what the server answered): 4 (a budget cut and a removed tenant mid-job),
6 (DELETE a file, expires_after), 8 (a cross-site upload and drain, a rebound Host without --auth), 9 (a
backend's password on /health, /fleet/replicas and the log), 10 (/fleet/replicas with an admin key), 11 (a job
of an admin key of no tenant), 12 (U+2028/U+0085 inside a line), 14 (a chunked upload past the limit, metadata,
a long filename). 13 and 15 have no HTTP surface to probe here: their tests say before and after.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

# One thread: on the shared, loaded 2 cores two OpenMP threads spin against each other (2.6 tokens/s measured).
SERVE_ARGS = ("--auth", "--threads", "1", "--max-num-seqs", "8", "--batch-lines-in-flight", "8",
              "--power-source", "constant", "--power-watts", "50", "--machine-profile", "off",
              "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--max-body-bytes", "16MiB",
              "--log-level", "warning")
FINAL = ("completed", "failed", "cancelled", "expired")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, log_dir: Path, args: tuple[str, ...] = SERVE_ARGS) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(self.port), "--data-dir",
               str(data_dir), *args]
        # PyTorch's attention: a start never waits on a kernel compile; no case here measures kernels.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENFACTORY_CPU_KERNELS": "0"}
        self.log_path = log_dir / f"server-{self.port}.log"
        # From the checkout's root: `python -m` puts the working directory first on the path, ahead of PYTHONPATH.
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                                     cwd=checkout_root())
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > 600:
                self.stop(signal.SIGKILL)
                raise RuntimeError("server did not start in 600 s")
            time.sleep(0.3)
        self.start_s = time.monotonic() - started

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def make_tenants(data_dir: Path, specs: dict[str, dict]) -> dict[str, str]:
    """Tenants in the checkout's own store (before the server starts); name -> API key."""
    from tokenfactory.meter.ledger import Ledger
    from tokenfactory.tenants.store import Budget, Tenant, TenantStore

    ledger = Ledger.open(data_dir)
    store = TenantStore(ledger.engine)
    keys = {"admin": store.create_key(None, is_admin=True)[0]}  # an admin key of no tenant
    for name, limits in specs.items():
        if "budget" in limits:
            limits = {**limits, "budget": Budget.parse(limits["budget"])}
        store.add_tenant(Tenant(name, **limits))
        keys[name] = store.create_key(name)[0]
    ledger.close()
    return keys


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def line(custom_id: str, max_tokens: int, chat: bool = False) -> str:
    if chat:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Tell a story ({custom_id})."}]}
        url = "/v1/chat/completions"
    else:
        body, url = {"prompt": f"Story {custom_id}: once"}, "/v1/completions"
    body.update(max_tokens=max_tokens, ignore_eos=True)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def submit(c: openai.OpenAI, lines: list[str], chat: bool = False) -> str:
    f = c.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h").id


def wait(c: openai.OpenAI, batch_id: str, done: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if done(b) or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


def ledger_rows(data_dir: Path, batch_id: str) -> list[dict]:
    with sqlite3.connect(data_dir / "ledger.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT request_id, status, completion_tokens FROM requests "
                                            "WHERE request_id LIKE ?", (batch_id + "-%",))]


def file_usage(c: openai.OpenAI, file_id: str | None) -> tuple[int, int]:
    """(lines, completion tokens their usage says) of an output or error file."""
    if not file_id:
        return 0, 0
    items = [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x.strip()]
    tokens = 0
    for item in items:
        usage = ((item.get("response") or {}).get("body") or {}).get("usage") or item.get("usage") or {}
        tokens += usage.get("completion_tokens") or 0
    return len(items), tokens


def job_report(c: openai.OpenAI, data_dir: Path, batch_id: str) -> dict:
    b = c.batches.retrieve(batch_id)
    rows = ledger_rows(data_dir, batch_id)
    out_lines, out_tokens = file_usage(c, b.output_file_id)
    err_lines, err_tokens = file_usage(c, b.error_file_id)
    return {"status": b.status, "request_counts": b.request_counts.model_dump(),
            "batch_usage_output_tokens": b.usage.output_tokens if getattr(b, "usage", None) else None,
            "output_file_lines": out_lines, "output_file_completion_tokens": out_tokens,
            "error_file_lines": err_lines, "error_file_completion_tokens": err_tokens,
            "ledger_rows": len(rows), "ledger_rows_aborted": sum(r["status"] == "aborted" for r in rows),
            "ledger_completion_tokens": sum(r["completion_tokens"] for r in rows)}


def case_restart(work: Path, num_lines: int, max_tokens: int) -> dict:
    """1: `num_lines` x `max_tokens`, SIGTERM 4 s into the job (each checkout's stop grace is 10 s, so lines
    longer than that are cut off), restart, wait for the end."""
    data_dir = work / f"c1-{num_lines}x{max_tokens}"
    key = make_tenants(data_dir, {"acme": {}})["acme"]
    first = Server(data_dir, work)
    c = client(first, key)
    batch_id = submit(c, [line(f"r{i}", max_tokens, chat=True) for i in range(num_lines)], chat=True)
    wait(c, batch_id, lambda b: b.status == "in_progress", 120)
    time.sleep(4)
    stop_started = time.monotonic()
    rc = first.stop(signal.SIGTERM)
    stop_s = time.monotonic() - stop_started
    rows_at_stop = ledger_rows(data_dir, batch_id)
    second = Server(data_dir, work)
    try:
        c = client(second, key)
        wait(c, batch_id, lambda b: b.status in FINAL, 1200)
        report = job_report(c, data_dir, batch_id)
        usage = httpx.get(second.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
        report["v1_usage_completion_tokens"] = sum(d.get("completion_tokens", 0) for d in usage.get("data", []))
    finally:
        second.stop()
    report.update(num_lines=num_lines, max_tokens=max_tokens, sigterm_exit=rc, stop_s=round(stop_s, 2),
                  aborted_rows_at_stop=sum(r["status"] == "aborted" for r in rows_at_stop),
                  rows_at_stop=len(rows_at_stop), expected_output_tokens=num_lines * max_tokens)
    report["unbilled_output_tokens"] = report["output_file_completion_tokens"] - report["ledger_completion_tokens"]
    return report


def case_stall(server: Server, c: openai.OpenAI) -> dict:
    """2: /health probed back to back while the hostile file is validated."""
    lines = [line(f"d{i}", 1, chat=True) for i in range(10_000)] + [line("same", 1, chat=True)] * 10_000
    f = c.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    latencies: list[float] = []
    busy, done = threading.Event(), threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            while not done.is_set():
                started = time.perf_counter()
                http.get("/health")
                if busy.is_set():
                    latencies.append(time.perf_counter() - started)
                time.sleep(0.005)
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.3)
    busy.set()
    started = time.monotonic()
    batch_id = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
    create_s = time.monotonic() - started
    while c.batches.retrieve(batch_id).status == "validating":
        time.sleep(0.02)
    validated_s = time.monotonic() - started
    busy.clear()
    done.set()
    thread.join(300)
    c.batches.cancel(batch_id)
    final = wait(c, batch_id, lambda b: b.status in FINAL, 600)
    ms = sorted(1000 * x for x in latencies)
    return {"file_bytes": f.bytes, "create_s": round(create_s, 3), "validated_s": round(validated_s, 3),
            "health_probes": len(ms), "health_median_ms": round(statistics.median(ms), 1) if ms else None,
            "health_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1) if ms else None,
            "health_max_ms": round(ms[-1], 1) if ms else None, "final_status": final.status,
            "request_counts": final.request_counts.model_dump()}


def case_rate_limited(c_slow: openai.OpenAI, c_quick: openai.OpenAI) -> dict:
    """3: a tenant with rpm=1 submits 40 lines; another tenant's one line, timed (60 s at most)."""
    held = submit(c_slow, [line(f"s{i}", 8) for i in range(40)])
    wait(c_slow, held, lambda b: b.request_counts.completed >= 1, 300)
    time.sleep(1)
    started = time.monotonic()
    quick = submit(c_quick, [line("q0", 8)])
    at_25 = wait(c_quick, quick, lambda b: b.status in FINAL or time.monotonic() - started > 25, 30)
    final = wait(c_quick, quick, lambda b: b.status in FINAL, 60 - (time.monotonic() - started))
    quick_s = time.monotonic() - started if final.status in FINAL else None
    slow_done = c_slow.batches.retrieve(held).request_counts.completed
    cancelled = time.monotonic()
    c_slow.batches.cancel(held)
    after = wait(c_quick, quick, lambda b: b.status in FINAL, 300)
    after_cancel_s = time.monotonic() - cancelled if quick_s is None else None
    wait(c_slow, held, lambda b: b.status in FINAL, 300)
    return {"quick_completed_at_25s": at_25.request_counts.completed, "quick_done_s": round(quick_s, 2)
            if quick_s is not None else None, "quick_status_at_60s": final.status,
            "quick_done_s_after_slow_cancelled": round(after_cancel_s, 2) if after_cancel_s is not None else None,
            "quick_final_status": after.status, "slow_completed_meanwhile": slow_done}


def case_cancel(c: openai.OpenAI, data_dir: Path) -> dict:
    """5: 400 lines x 24 tokens, cancelled once 4 are done."""
    batch_id = submit(c, [line(f"c{i}", 24) for i in range(400)])
    wait(c, batch_id, lambda b: b.request_counts.completed >= 4, 600)
    c.batches.cancel(batch_id)
    wait(c, batch_id, lambda b: b.status in FINAL, 600)
    time.sleep(2)  # the aborted rows' settlement, in the background
    report = job_report(c, data_dir, batch_id)
    report["unreported_output_tokens"] = report["ledger_completion_tokens"] - report["output_file_completion_tokens"] \
        - report["error_file_completion_tokens"]
    return report


def case_memory(server: Server, c: openai.OpenAI) -> dict:
    """7: RSS with two queued 50,000-line jobs of one file, and after cancelling them."""
    lines = [json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "max_tokens": 1}}) for i in range(50_000)]
    f = c.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    del lines
    time.sleep(2)
    rss = {"uploaded": server.rss_mib()}
    ids = []
    for n in (1, 2):
        ids.append(c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
        wait(c, ids[-1], lambda b: b.status != "validating", 600)
        time.sleep(3)
        rss[f"{n}_queued"] = server.rss_mib()
    for batch_id in ids:
        c.batches.cancel(batch_id)
    finals = [wait(c, b, lambda b: b.status in FINAL, 600) for b in ids]
    time.sleep(3)
    rss["cancelled"] = server.rss_mib()
    return {"file_bytes": f.bytes, "rss_mib": {k: round(v, 1) for k, v in rss.items()},
            "mib_per_queued_job": round((rss["2_queued"] - rss["uploaded"]) / 2, 1),
            "mib_kept_after_cancel": round(rss["cancelled"] - rss["uploaded"], 1),
            "final_statuses": [b.status for b in finals],
            "lines_done_before_cancel": [b.request_counts.completed for b in finals]}


def probe(fn: Any) -> dict:
    """One probe's answer, or what it raised (a probe that breaks does not stop the run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded as the probe's outcome
        return {"probe_error": f"{type(e).__name__}: {str(e)[:300]}"}


def status_of(r: httpx.Response) -> dict:
    try:
        error = r.json().get("error") or {}
    except ValueError:
        error = {}
    return {"status": r.status_code, "code": error.get("code") if isinstance(error, dict) else None,
            "message": (error.get("message") or "")[:160] if isinstance(error, dict) else r.text[:160]}


def probes_auth(server: Server, keys: dict[str, str]) -> dict:
    """4 and 11 on the --auth server."""
    admin = client(server, keys["admin"])
    admin_http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=60)

    def cut(tenant: str, change: Any) -> dict:
        c = client(server, keys[tenant])
        batch_id = submit(c, [line(f"b{i}", 8) for i in range(24)])
        wait(c, batch_id, lambda b: b.request_counts.completed >= 4, 600)
        done_at_change = c.batches.retrieve(batch_id).request_counts.completed
        answer = change()
        interactive = httpx.post(server.url + "/v1/completions", timeout=120, headers={
            "Authorization": f"Bearer {keys[tenant]}"}, json={"prompt": "hi", "max_tokens": 2})
        final = wait(admin, batch_id, lambda b: b.status in FINAL, 900)
        errors = final.errors.data if final.errors and final.errors.data else []
        return {"change": answer, "completed_at_change": done_at_change,
                "interactive_after_change": interactive.status_code, "final_status": final.status,
                "request_counts": final.request_counts.model_dump(), "error_code": errors[0].code if errors else None}

    def admin_job() -> dict:
        final = wait(admin, submit(admin, [line(f"a{i}", 4) for i in range(3)]), lambda b: b.status in FINAL, 600)
        first_error = None
        if final.error_file_id:
            first = json.loads(admin.files.content(final.error_file_id).text.splitlines()[0])
            first_error = ((first.get("response") or {}).get("body") or {}).get("error", first.get("error"))
        return {"final_status": final.status, "request_counts": final.request_counts.model_dump(),
                "first_error": first_error}

    return {
        "4_budget_cut": probe(lambda: cut("budgeted", lambda: status_of(admin_http.patch(
            "/admin/tenants/budgeted", json={"budget": "1 tok/day"}))["status"])),
        "4_tenant_removed": probe(lambda: cut("doomed", lambda: status_of(admin_http.delete(
            "/admin/tenants/doomed"))["status"])),
        "11_admin_key_of_no_tenant": probe(admin_job),
    }


CROSS_SITE = {"Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"}
SECRET = "s3cretpw"


def first_local_replica(http: httpx.Client) -> str:
    replicas = http.get("/fleet/replicas").json()
    rows = replicas.get("data", replicas.get("replicas", replicas)) if isinstance(replicas, dict) else replicas
    return next(r["replica_id"] for r in rows if r["kind"] != "backend")


def probes_no_auth(server: Server) -> dict:
    """6, 8, 9, 12 and 14 on a server without --auth, whose fleet has a dead backend with a password."""
    http = httpx.Client(base_url=server.url, timeout=120)
    c = client(server, "none")
    upload = {"files": {"file": ("x.jsonl", b'{"x": 1}\n')}, "data": {"purpose": "batch"}}

    def password() -> dict:
        deadline = time.monotonic() + 120
        while "failed 3 health checks" not in (health := http.get("/health").text) and time.monotonic() < deadline:
            time.sleep(0.5)
        return {"health_says_failed": "failed 3 health checks" in health, "secret_in_health": SECRET in health,
                "secret_in_fleet_replicas": SECRET in http.get("/fleet/replicas").text,
                "secret_in_log": SECRET in server.log_path.read_text(),
                "health_replicas_down": json.dumps(json.loads(health).get("replicas_down")).replace(
                    SECRET, "<the password>")[:400]}

    def cross_site() -> dict:
        replica = first_local_replica(http)
        events = {}
        with http.stream("GET", "/dashboard/events", headers={"Host": "attacker.example"}) as r:
            events = {"status": r.status_code}
        answers = {"upload_cross_site": status_of(http.post("/v1/files", headers=CROSS_SITE, **upload)),
                   "upload_from_a_program": status_of(http.post("/v1/files", **upload)),
                   "dashboard_events_rebound_host": events,
                   "health_rebound_host": http.get("/health", headers={"Host": "attacker.example"}).status_code,
                   f"drain_{replica}_cross_site": status_of(http.post(f"/fleet/replicas/{replica}/drain",
                                                                      headers=CROSS_SITE))}
        answers["replicas_after"] = [{k: r.get(k) for k in ("replica_id", "kind", "state")}
                                     for r in http.get("/fleet/replicas").json()["data"]]
        return answers

    def files() -> dict:
        f = c.files.create(file=("d.jsonl", io.BytesIO(b'{"x": 1}\n')), purpose="batch")
        deleted = http.delete(f"/v1/files/{f.id}")
        kept = http.post("/v1/files", files={"file": ("e.jsonl", b'{"x": 1}\n')},
                         data={"purpose": "batch", "expires_after[anchor]": "created_at",
                               "expires_after[seconds]": "3600"}).json()
        return {"delete": status_of(deleted), "get_after_delete": http.get(f"/v1/files/{f.id}").status_code,
                "expires_at_given": kept.get("expires_at") is not None,
                "expires_in_s": kept["expires_at"] - kept["created_at"] if kept.get("expires_at") else None}

    def separators() -> dict:
        prompts = ["a\u2028b", "c\u0085d", "e\u2029f"]
        content = "\n".join(json.dumps({"custom_id": f"u{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": p, "max_tokens": 2}}, ensure_ascii=False)
                            for i, p in enumerate(prompts)).encode()
        f = c.files.create(file=("u.jsonl", io.BytesIO(content)), purpose="batch")
        final = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                         completion_window="24h").id, lambda b: b.status in FINAL, 300)
        return {"lines_in_file": 3, "final_status": final.status, "request_counts": final.request_counts.model_dump()}

    def bounds() -> dict:
        def chunks():  # noqa: ANN202 - 2 MB of file in a multipart body with no Content-Length
            yield b'--tfb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--tfb\r\n' \
                  b'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
            for _ in range(20):
                yield b"x" * 99_999 + b"\n"
            yield b"\r\n--tfb--\r\n"
        f = c.files.create(file=("m.jsonl", io.BytesIO(line("m0", 2).encode())), purpose="batch")
        body = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"}
        return {"chunked_upload_past_limit": status_of(http.post(
                    "/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; boundary=tfb"})),
                "metadata_17_pairs": status_of(http.post("/v1/batches", json={
                    **body, "metadata": {f"k{i}": "v" for i in range(17)}})),
                "metadata_64_pairs_of_600": status_of(http.post("/v1/batches", json={
                    **body, "metadata": {f"k{i}": "v" * 600 for i in range(64)}})),
                "filename_1006_chars": status_of(http.post("/v1/files", files={
                    "file": ("n" * 1000 + ".jsonl", b'{"x": 1}\n')}, data={"purpose": "batch"}))}

    return {"9_backend_password": probe(password), "6_files": probe(files), "12_line_separators": probe(separators),
            "14_bounds": probe(bounds), "8_cross_site": probe(cross_site)}  # 8 last: it may drain the replica


def probe_fleet_auth(server: Server, keys: dict[str, str]) -> dict:
    """10: /fleet/replicas with --auth, as an admin and as a tenant."""
    def get(key: str) -> int:
        return httpx.get(server.url + "/fleet/replicas", headers={"Authorization": f"Bearer {key}"},
                         timeout=60).status_code
    return {"admin_key": get(keys["admin"]), "tenant_key": get(keys["t"]),
            "no_key": httpx.get(server.url + "/fleet/replicas", timeout=60).status_code}


def dead_backend_args(with_auth: bool, max_body: str) -> tuple[str, ...]:
    """SERVE_ARGS in fleet mode: one local replica and a backend on a closed port whose URL has a password."""
    from tokenfactory.models.loader import bundled_model_path

    gguf = bundled_model_path()
    args = [a for a in SERVE_ARGS if with_auth or a != "--auth"]
    args[args.index("--max-body-bytes") + 1] = max_body
    return (*args, "--backend", f"http://user:{SECRET}@127.0.0.1:{free_port()},model=ghost,tokenizer={gguf}")


def checkout_root() -> Path:
    import tokenfactory

    return Path(tokenfactory.__file__).resolve().parent.parent


def checkout() -> dict:
    root = checkout_root()
    head = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()
    return {"path": str(root), "commit": head[:120]}


def machine() -> dict:
    model = next((x.split(":", 1)[1].strip() for x in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if x.startswith("Model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "load_average": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="before or after")
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="1,2,3,5,7,probes")
    p.add_argument("--restart-shape", default="4x256", help="case 1's job: LINESxMAX_TOKENS")
    args = p.parse_args()
    cases = {int(x) if x.isdigit() else x for x in args.cases.split(",")}
    result: dict[str, Any] = {"label": args.label, "checkout": checkout(), "machine_at_start": machine(),
                              "serve_args": list(SERVE_ARGS), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="issue25-") as tmp:
        work = Path(tmp)
        if 1 in cases:
            num_lines, max_tokens = (int(x) for x in args.restart_shape.split("x"))
            name = "1_restart_billing" + ("" if args.restart_shape == "4x256" else f"_{args.restart_shape}")
            print(f"case 1: restart billing, {args.restart_shape}", flush=True)
            result["cases"][name] = case_restart(work, num_lines, max_tokens)
            print(json.dumps(result["cases"][name]), flush=True)
        if cases & {2, 3, 5, 7, "probes"}:
            data_dir = work / "shared"
            keys = make_tenants(data_dir, {"hostile": {}, "slow": {"rpm": 1}, "quick": {}, "canceller": {},
                                           "queuer": {}, "budgeted": {"budget": "1M tokens/day"}, "doomed": {}})
            server = Server(data_dir, work)
            result["server_start_s"] = round(server.start_s, 1)
            try:
                for number, name, run in (
                        (2, "2_validation_stall", lambda: case_stall(server, client(server, keys["hostile"]))),
                        (3, "3_rate_limited_tenant", lambda: case_rate_limited(client(server, keys["slow"]),
                                                                               client(server, keys["quick"]))),
                        (5, "5_cancel_billing", lambda: case_cancel(client(server, keys["canceller"]), data_dir)),
                        ("probes", "probes_auth", lambda: probes_auth(server, keys)),
                        (7, "7_queued_job_memory", lambda: case_memory(server, client(server, keys["queuer"])))):
                    if number in cases:
                        print(f"case {number}: {name}", flush=True)
                        result["cases"][name] = run()
                        print(json.dumps(result["cases"][name]), flush=True)
            finally:
                server.stop()
        if "probes" in cases:
            print("probes without --auth (a fleet with a dead backend)", flush=True)
            server = Server(work / "noauth", work, dead_backend_args(False, "1MiB"))
            try:
                result["cases"]["probes_no_auth"] = probes_no_auth(server)
            finally:
                server.stop()
            print(json.dumps(result["cases"]["probes_no_auth"]), flush=True)
            keys = make_tenants(work / "fleetauth", {"t": {}})
            server = Server(work / "fleetauth", work, dead_backend_args(True, "16MiB"))
            try:
                result["cases"]["10_fleet_with_auth"] = probe_fleet_auth(server, keys)
            finally:
                server.stop()
            print(json.dumps(result["cases"]["10_fleet_with_auth"]), flush=True)
    result["machine_at_end"] = machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
