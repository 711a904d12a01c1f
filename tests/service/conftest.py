"""Fixtures of the service tests: a database URL per test, parametrised over SQLite and
a real PostgreSQL server (marker `postgres`), an app with a scripted backend, and
helpers to create tenants and keys through the admin API.

The PostgreSQL server starts once per session; each test gets a fresh schema in it.
In CI (`CI` set) missing PostgreSQL binaries fail the tests instead of skipping them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from pg_server import INSTALL_HINT, PgServer, find_bin_dir, running_server

from helpers.service_support import ADMIN_KEY, ScriptedBackend, Tenants
from marlaas.service.app import create_app, open_context
from marlaas.service.context import ServiceContext
from marlaas.service.settings import QuotaSpec, ServiceSettings

_schemas = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail(f"{INSTALL_HINT}; CI must run the postgres tests", pytrace=False)
        pytest.skip(INSTALL_HINT)
    with running_server(bin_dir) as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'service.db'}"
    # A fresh schema per test in one database: far cheaper than a database per test
    # (each CREATE DATABASE copies a template of several MB).
    server: PgServer = request.getfixturevalue("pg_server")
    schema = f"t{next(_schemas)}"
    with psycopg.connect(
        host="127.0.0.1", port=server.port, user=server.user, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return f"{server.url('postgres')}?options=-csearch_path%3D{schema}"


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> ServiceSettings:
    return ServiceSettings(
        data_dir=tmp_path / "data",
        db_url=db_url,
        admin_key=ADMIN_KEY,
        max_body_bytes=64 * 1024,
        max_upload_bytes=256 * 1024,
        default_quotas=QuotaSpec(
            max_concurrent_jobs=3, max_total_steps=100, max_dataset_bytes=100_000
        ),
    )


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture
def make_client(
    settings: ServiceSettings, backend: ScriptedBackend
) -> Iterator[Callable[..., TestClient]]:
    """`make_client(with_backend=True)`: a started app over the test's database."""
    clients: list[TestClient] = []

    def make(with_backend: bool = True) -> TestClient:
        ctx, _ = open_context(settings)
        app = create_app(ctx, backend.attach if with_backend else None)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture
def context(client: TestClient) -> ServiceContext:
    ctx: ServiceContext = client.app.state.context  # type: ignore[attr-defined]
    return ctx


@pytest.fixture
def tenants(client: TestClient) -> Tenants:
    return Tenants(client)
