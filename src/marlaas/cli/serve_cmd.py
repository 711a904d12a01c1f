"""`marlaas serve`: the HTTP service under uvicorn, bound to 127.0.0.1 by default.

`--backend` says where the jobs run:
- `inprocess` (default): the pipeline backend (`service.pipeline_backend`) in this
  process, on the embedded base (or `--base-model`);
- `ray`: the same pipeline with its engine replicas, trainer and environment workers as
  Ray actors (`marlaas.distributed`), placed by `--ray-spec` (a `RaySpec` YAML file;
  default: a private single-node Ray on loopback). The server joins Ray on its main
  thread before uvicorn starts, so Ray's processes live as long as the server and
  uvicorn's SIGTERM handling (checkpoint, then exit) stays in place;
- `none` (alias `--no-backend`): the API only: jobs are accepted, validated, stored and
  managed, but stay queued; the startup log says so.

With a backend, at startup it resumes every job the database says is active, and
SIGTERM checkpoints running jobs before the server exits, within 10 s whatever runs
(open requests get `app.GRACEFUL_SHUTDOWN_S`, the backend `shutdown_timeout_s`).

The engine and trainer sizes (`ServiceSettings.max_batch_rows`, `max_lora_rank`,
`max_tokens_per_microbatch`, `env_timeout_s`) size the pipeline and are what job
submissions are checked against, so both always agree.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from marlaas.cli.process import device_process
from marlaas.config.specs import DTYPE_HELP, check_dtype, parse_target_modules

if TYPE_CHECKING:
    from marlaas.config.ray import RaySpec

DB_URL_ENV = "MARLAAS_DB_URL"


class Backend(StrEnum):
    """Where `marlaas serve` runs the jobs."""

    inprocess = "inprocess"
    ray = "ray"
    none = "none"


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
    backend: Backend | None = typer.Option(
        None,
        "--backend",
        help="Where jobs run: inprocess (this process; the default), ray (Ray actors "
        "placed by --ray-spec), or none (the API only; jobs stay queued).",
        show_default=False,
    ),
    no_backend: bool = typer.Option(
        False, "--no-backend", help="Serve the API only: the same as --backend none."
    ),
    ray_spec: Path | None = typer.Option(
        None,
        "--ray-spec",
        help="YAML file of the Ray spec (address, engine_replicas, env_workers, resources; "
        "--backend ray only). Default: a private single-node Ray on 127.0.0.1.",
    ),
    base_model: Path | None = typer.Option(
        None, help="Hugging Face causal-LM directory of the shared base (default: embedded)."
    ),
    device: str = typer.Option("auto", help="Torch device of the base: auto, cpu, cuda, ..."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    target_modules: str | None = typer.Option(
        None,
        "--target-modules",
        help="LoRA targets of the jobs that leave lora.target_modules unset: "
        "comma-separated leaf names of the base's linear layers (q_proj,v_proj) or "
        "all-linear (the default).",
    ),
    max_active_jobs: int = typer.Option(
        32, min=1, max=4096, help="Jobs trained at once; further jobs wait in a queue."
    ),
    max_batch_rows: int = typer.Option(
        64,
        min=1,
        max=4096,
        help="Rows the engine decodes at once, all tenants together (jobs' groups, "
        "inference and Tinker sampling share them); size it for the tenants served at once.",
    ),
) -> None:
    """Serve the job API. The admin key comes from $MARLAAS_ADMIN_KEY, or is generated
    at first start and printed once."""
    import uvicorn

    device_process()

    from marlaas.service.app import GRACEFUL_SHUTDOWN_S, create_app, open_context
    from marlaas.service.settings import (
        ADMIN_KEY_ENV,
        ServiceSettings,
        admin_key_from_env,
        metrics_token_from_env,
    )

    chosen, ray = resolve_backend(backend, no_backend, ray_spec)
    model_dtype = check_dtype(dtype)
    targets = parse_target_modules(target_modules)
    base_dir = base_model.resolve() if base_model else None
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    settings = ServiceSettings(
        data_dir=data_dir.resolve(),
        db_url=db_url or os.environ.get(DB_URL_ENV) or None,
        admin_key=admin_key_from_env(),
        metrics_token=metrics_token_from_env(),
        # The OpenAI routes serve this base (`--backend none`); with a backend, only the
        # backend's own engine, on the same base, ever answers. Jobs are checked
        # against it too (`service.admission`).
        serve_base_model=base_dir,
        serve_device=device,
        serve_dtype=model_dtype,
        default_target_modules=targets,
        max_batch_rows=max_batch_rows,
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
    if chosen is Backend.none:
        what = "none -- jobs are accepted and stored but stay queued (--backend none)"
    else:
        from marlaas.pipeline.context import PipelineOptions
        from marlaas.service.judges import ServiceJudges
        from marlaas.service.pipeline_backend import PipelineBackend

        spec = settings.pipeline_spec(
            backend="ray" if chosen is Backend.ray else "inprocess",
            ray=ray,
            max_active_tenants=max_active_jobs,
        )
        options = PipelineOptions(device=device, env_timeout_s=settings.env_timeout_s)
        factory = PipelineBackend.factory(
            ctx.db, spec=spec, options=options, judges=ServiceJudges(ctx)
        )
        what = f"pipeline on {base_model or 'the embedded base'} ({device}, dtype {dtype})"
        if ray is not None:
            # On this (the main) thread, before uvicorn installs its signal handlers:
            # Ray's processes are tied to the thread that joined, and `ray.init` on the
            # main thread replaces the SIGTERM handler.
            from marlaas.distributed import connect

            connect(ray)
            where = ray.address or "a private local Ray on 127.0.0.1"
            what += (
                f" on Ray ({where}; {ray.engine_replicas} engine replica(s), "
                f"{ray.env_workers} environment worker(s))"
            )
    typer.echo(
        f"marlaas serve: http://{host}:{port} (docs at /docs); database: {ctx.db.dialect}; "
        f"job backend: {what}",
        err=True,
    )
    uvicorn.run(
        create_app(ctx, factory),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def resolve_backend(
    backend: Backend | None, no_backend: bool, ray_spec: Path | None
) -> tuple[Backend, RaySpec | None]:
    """The chosen backend and, for `ray`, its spec (read from `ray_spec`, else defaults).
    `ConfigError` names the option to fix: contradictory options, a Ray spec without the
    Ray backend, an unreadable or invalid spec file, Ray not installed."""
    from marlaas.config.ray import RaySpec, check_ray_installed, load_ray_spec
    from marlaas.errors import ConfigError

    if no_backend and backend not in (None, Backend.none):
        raise ConfigError(
            f"--no-backend contradicts --backend {backend.value}; pass only one of them"
        )
    chosen = Backend.none if no_backend else (backend or Backend.inprocess)
    if chosen is not Backend.ray:
        if ray_spec is not None:
            raise ConfigError(
                f"--ray-spec applies to --backend ray only (the backend is {chosen.value}); "
                "add --backend ray or drop --ray-spec"
            )
        return chosen, None
    spec = load_ray_spec(ray_spec) if ray_spec is not None else RaySpec()
    check_ray_installed()
    return chosen, spec
