"""`tokenfactory serve`: the OpenAI-compatible server on our engine. With no flags, the bundled model."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenfactory.serve.engine import start_engine
from tokenfactory.serve.flags import (
    add_engine_args,
    add_fleet_args,
    add_limit_args,
    batch_settings_from_args,
    fleet_mode,
    limit_settings_from_args,
    parse_memory,
    read_baseline,
    responses_settings_from_args,
    scheduling_policy,
)
from tokenfactory.serve.fleet import start_fleet
from tokenfactory.serve.wiring import build_tenancy, display_url, wire_app

logger = logging.getLogger("tokenfactory.serve")

def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenfactory.levers import HelpFormatter

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the file's name)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond this get 503")
    p.add_argument("--max-body-bytes", type=parse_memory, default=4 << 20,
                   help="request bodies beyond this size get 413 (bytes, or 4MiB)")
    p.add_argument("--stream-send-timeout", type=float, default=30.0,
                   help="seconds a streaming client may take no data before it is dropped and its request "
                        "aborted (and billed for what was made)")
    p.add_argument("--direct-stream-writes", action=argparse.BooleanOptionalAction, default=True,
                   help="write a plain stream's token chunks from the engine's thread straight to the socket, "
                        "without waking the event loop for each (docs/server.md, \"Direct stream writes\")")
    p.add_argument("--data-dir", default=None, help="where the ledger lives (default: a per-user directory)")
    p.add_argument("--database-url", default=None, help="a SQLAlchemy URL instead of SQLite in --data-dir")
    p.add_argument("--power-source", default="auto",
                   help="auto, nvml, rapl, modelled, constant (or several joined with '+')")
    p.add_argument("--power-watts", type=float, default=None, help="watts for --power-source constant")
    p.add_argument("--cpu-tdp-watts", type=float, default=None, help="TDP for the modelled source")
    p.add_argument("--prices", default=None, help="a prices TOML file merged over the dated defaults")
    p.add_argument("--device-profile", default=None, help="the prices file's device profile (default: matched)")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument("--baseline", default=None, metavar="RESULT.json",
                   help="a saved `tokenfactory bench serve --save NAME` run (results/NAME.json) made on this machine: "
                        "its joules per output token go to /metrics for the J/token regression alert (deploy/)")
    p.add_argument("--auth", action="store_true",
                   help="require API keys (tenants and keys in --data-dir; see `tokenfactory tenants` and `keys`)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without --auth, a host name requests may be addressed to besides IP addresses and localhost "
                        "(repeatable; '*': any). Other names are refused, so that a web page cannot reach the server "
                        "through DNS rebinding (docs/server.md, \"Trust without --auth\")")
    add_limit_args(p)
    g = p.add_argument_group("batch API (docs/batch.md)")
    g.add_argument("--batch-lines-in-flight", type=int, default=32,
                   help="Batch API lines in the engine at once, all jobs together")
    g.add_argument("--batch-lines-per-tenant", type=int, default=None,
                   help="of those, the most one tenant's jobs hold at once (default: half; all of them without --auth)")
    g.add_argument("--batch-jobs-per-tenant", type=int, default=16, help="batches one tenant may have running")
    g.add_argument("--batch-storage-per-tenant", type=parse_memory, default=1 << 30,
                   help="bytes of Batch API files one tenant may keep (default 1GiB)")
    g.add_argument("--batch-stop-grace", type=float, default=10.0,
                   help="at shutdown, seconds the lines in flight get to finish before they are cut off (they run "
                        "again at the next start, billed once)")
    g.add_argument("--batch-cancel-grace", type=float, default=60.0,
                   help="seconds a cancelled (or stopped) batch's lines in flight get to finish before they are cut "
                        "off and reported with what they billed")
    p.add_argument("--responses-retention-days", type=float, default=30.0,
                   help="how long a stored Responses API response (store: true, the default) can be retrieved and "
                        "continued with previous_response_id, kept per tenant in the ledger's database (OpenAI's: 30)")
    add_fleet_args(p)
    from tokenfactory.serve.scenario import add_profile_args  # serve --profile (planner/scenarios.py)

    add_profile_args(p)
    # What each flag is when not given, so that --profile sets only those the user left alone.
    p.set_defaults(func=serve, flag_defaults=vars(p.parse_args([])))


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from tokenfactory.engine.client import ChargeEnergy
    from tokenfactory.gateway.app import ServerSettings
    from tokenfactory.gateway.limits import raise_fd_limit, wrap_app

    try:
        limits = limit_settings_from_args(args)
        baseline = read_baseline(args.baseline) if getattr(args, "baseline", None) else None
        from tokenfactory.serve.scenario import apply_profile

        args, profile_line = apply_profile(args, getattr(args, "flag_defaults", {}))
        started = start_fleet(args) if fleet_mode(args) else start_engine(args)
    except (ValueError, RuntimeError, FileNotFoundError, OSError, SQLAlchemyError) as e:
        print(f"tokenfactory serve: cannot start: {e}", file=sys.stderr)
        return 2
    client, accounting, name = started.client, started.accounting, started.name
    if scheduling_policy(args) == "vtc-joules":  # the meter's measured joules charge the tenants' counters
        accounting.meter.energy_listeners.append(lambda joules: client.send(ChargeEnergy(joules)))

    def shutdown() -> None:  # after uvicorn drained the requests and the app its pending ledger rows
        if started.autoscaling is not None:  # no replica starts or stops while the fleet shuts down
            started.autoscaling.stop()
        client.shutdown()
        accounting.meter.close()
        accounting.close()

    settings = ServerSettings(served_model_name=name, max_waiting=args.max_waiting,
                              max_body_bytes=int(args.max_body_bytes),
                              stream_send_timeout_s=args.stream_send_timeout,
                              direct_stream_writes=args.direct_stream_writes, baseline=baseline)
    tenancy, auth_line = build_tenancy(args, client, accounting)
    app = wire_app(client, settings, accounting, tenancy, on_shutdown=shutdown, models=started.extra_models,
                   allowed_hosts=tuple(args.allowed_host), batch=batch_settings_from_args(args),
                   responses=responses_settings_from_args(args))
    if started.nodes is not None:  # GET /fleet/nodes, the node_* series: each Ray node's own energy
        from tokenfactory.gateway.fleet_routes import install_node_routes

        install_node_routes(app, started.nodes, app.state.metrics.registry, tenancy)
    if started.autoscaling is not None:  # GET /fleet/autoscaler, its /metrics, the TTFT feed
        from tokenfactory.serve.autoscale import install_autoscaler_routes

        install_autoscaler_routes(app, started.autoscaling, app.state.metrics.registry, app.state.metrics.ttft, name)
    print("\n".join([f"tokenfactory serving {name}", *started.banner,
                     *([f"  profile {profile_line}"] if profile_line else []),
                     f"  power   {started.power}",
                     f"  prices  {started.prices}",
                     f"  ledger  {display_url(accounting.ledger.url)}",
                     f"  auth    {auth_line}",
                     f"  limits  {limits.describe()}",
                     f"  url     http://{args.host}:{args.port}/v1"]), flush=True)
    if fd_warning := raise_fd_limit(limits):
        logger.warning("limits: %s", fd_warning)
    uvicorn.run(wrap_app(app, limits), host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30, **limits.uvicorn_kwargs())
    return 0
