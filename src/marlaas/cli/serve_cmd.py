"""`marlaas serve`: the HTTP service under uvicorn, bound to 127.0.0.1 by default.

By default the jobs run in this process, in the pipeline backend
(`service.pipeline_backend`) on the embedded base (or `--base-model`); at startup it
resumes every job the database says is active, and SIGTERM checkpoints running jobs
before the server exits. `--no-backend` serves the API only: jobs are accepted,
validated, stored and managed, but stay queued; the startup log says so.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

import typer

DB_URL_ENV = "MARLAAS_DB_URL"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback by default."),
    port: int = typer.Option(8321, min=1, max=65535, help="TCP port."),
    data_dir: Path = typer.Option(
        Path("marlaas-data"), help="Holds the SQLite database and the artifacts."
    ),
    db_url: str | None = typer.Option(
        None,
        help="Database URL, e.g. postgresql+psycopg://user:pw@127.0.0.1/marlaas "
        f"(default: ${DB_URL_ENV}, else SQLite in --data-dir).",
    ),
    log_level: str = typer.Option("info", help="uvicorn log level."),
    backend: bool = typer.Option(
        True,
        "--backend/--no-backend",
        help="Run jobs in this process (default), or serve the API only (jobs stay queued).",
    ),
    base_model: Path | None = typer.Option(
        None, help="Hugging Face causal-LM directory of the shared base (default: embedded)."
    ),
    device: str = typer.Option("auto", help="Torch device of the base: auto, cpu, cuda, ..."),
    max_active_jobs: int = typer.Option(
        32, min=1, max=4096, help="Jobs trained at once; further jobs wait in a queue."
    ),
) -> None:
    """Serve the job API. The admin key comes from $MARLAAS_ADMIN_KEY, or is generated
    at first start and printed once."""
    import uvicorn

    from marlaas.service.app import create_app, open_context
    from marlaas.service.settings import ADMIN_KEY_ENV, ServiceSettings, admin_key_from_env

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    settings = ServiceSettings(
        data_dir=data_dir.resolve(),
        db_url=db_url or os.environ.get(DB_URL_ENV) or None,
        admin_key=admin_key_from_env(),
    )
    ctx, new_admin_key = open_context(settings)
    if new_admin_key is not None:
        typer.echo(
            f"admin key (shown once, only its hash is stored; set ${ADMIN_KEY_ENV} to use "
            f"your own): {new_admin_key}",
            err=True,
        )
    if not _is_loopback(host):
        typer.echo(f"warning: binding {host}, reachable beyond this machine", err=True)
    factory = None
    if backend:
        from marlaas.config.job import EngineSpec
        from marlaas.pipeline.context import PipelineOptions
        from marlaas.pipeline.runtime import RuntimeSpec
        from marlaas.service.pipeline_backend import PipelineBackend

        spec = RuntimeSpec(
            base_model=str(base_model.resolve()) if base_model else None,
            max_active_tenants=max_active_jobs,
            max_staleness=settings.max_staleness,
            engine=EngineSpec(max_rank=settings.max_lora_rank),
        )
        factory = PipelineBackend.factory(ctx.db, spec=spec, options=PipelineOptions(device=device))
        what = f"pipeline on {base_model or 'the embedded base'} ({device})"
    else:
        what = "none -- jobs are accepted and stored but stay queued (--no-backend)"
    typer.echo(
        f"marlaas serve: http://{host}:{port} (docs at /docs); database: {ctx.db.dialect}; "
        f"job backend: {what}",
        err=True,
    )
    uvicorn.run(create_app(ctx, factory), host=host, port=port, log_level=log_level)
