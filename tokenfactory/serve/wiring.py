"""What `serve` wires around the engine client, once for the real server and the tests' in-process one: the
tenancy (auth, admission, fair-share weights) and the app with the Batch API installed (`wire_app`)."""

from __future__ import annotations

import argparse
import re

from tokenfactory.serve.flags import scheduling_policy


def display_url(url: str) -> str:
    """A database URL with its password hidden, for the banner and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy reads: still hide what sits between ':' and '@'
        return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def build_tenancy(args: argparse.Namespace, client, accounting):  # noqa: ANN001, ANN201 - (Tenancy, banner line)
    """Auth (with --auth), admission limits and budgets, and the tenants' fair-share weights (sent to the
    engine through its client)."""
    from tokenfactory.engine.client import SetTenantWeight
    from tokenfactory.service.admission import Admission
    from tokenfactory.service.tenancy import Tenancy
    from tokenfactory.tenants.store import TenantStore

    def set_weight(tenant: str, weight: float) -> None:
        client.send(SetTenantWeight(tenant, weight))

    admission = Admission(accounting.ledger, max_waiting=args.max_waiting)
    if not args.auth:
        return (Tenancy(None, admission, set_weight),
                f"off (anyone who can reach the port can use it); scheduling {scheduling_policy(args)}")
    store = TenantStore(accounting.ledger.engine)
    num_tenants, num_admin = len(store.list_tenants()), sum(k.is_admin for k in store.list_keys())
    hint = "" if num_admin else "; no admin key yet: `tokenfactory keys create --admin`"
    return (Tenancy(store, admission, set_weight),
            f"on: API keys required ({num_tenants} tenants){hint}; scheduling {scheduling_policy(args)}")


def wire_app(client, settings, accounting, tenancy, *, on_shutdown=None, models=None,  # noqa: ANN001, ANN201
             allowed_hosts: tuple[str, ...] = (), batch=None, responses=None):  # noqa: ANN001
    """The app `serve` runs (FastAPI; imported here, not at registration): `build_app` over the engine client
    (and `models`' clients), with the Batch API's routes and runner installed (`batch`: its BatchSettings) and
    the Responses API's (`responses`: its ResponsesSettings)."""
    from tokenfactory.batch.routes import install_batch_routes
    from tokenfactory.batch.runner import BatchSettings
    from tokenfactory.gateway.app import build_app
    from tokenfactory.responses.routes import install_responses_routes

    app = build_app(client, settings, accounting, on_shutdown=on_shutdown, tenancy=tenancy, models=models,
                    allowed_hosts=allowed_hosts)
    install_batch_routes(app, app.state.service, batch or BatchSettings())  # /v1/files, /v1/batches
    install_responses_routes(app, app.state.service, responses)  # /v1/responses
    return app
