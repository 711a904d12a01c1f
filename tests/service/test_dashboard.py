"""The tenant dashboard: the page and its files are served, `GET /v1/usage/device`
answers with and without a device figure, and, end to end (marker `browser`), a real
server on a loopback port driven through Debian's Chromium with Playwright: sign-in
errors, the jobs table, curves, device utilization, checkpoints and their download,
auto-refresh, sign-out, and a screenshot.

Playwright only drives the system `chromium`; its own browser downloads are never used.
In CI (`CI` set) a missing chromium or playwright fails the browser test instead of
skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tarfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ADMIN_KEY, ScriptedBackend, Tenants, job_body
from marlaas.config.specs import LoRASpec
from marlaas.obs.memory import RunRecorder
from marlaas.service.app import create_app, open_context
from marlaas.service.context import ServiceContext
from marlaas.service.models import utcnow
from marlaas.service.reporter import JobReporter
from marlaas.service.settings import ServiceSettings
from marlaas.service.tinker.store import TinkerStore
from marlaas.service.usage import BusyBin, RecorderDeviceUsage

CHROMIUM_HINT = (
    "Debian's chromium is not installed (needed by the dashboard's browser test); "
    "install it with `make system-deps` or `apt-get install -y chromium`"
)
PLAYWRIGHT_HINT = "playwright is not installed; run `.venv/bin/pip install -e '.[dev]'`"


@dataclass
class FakeDevice:
    """A device usage provider with fixed busy fractions, the newest bin ending now."""

    busy: tuple[float, ...] = (0.2, 0.55, 0.9, 0.75)
    fail: bool = False

    def device_utilization(self, window_s: float, bin_s: float) -> list[BusyBin]:
        if self.fail:
            raise RuntimeError("the recorder is gone")
        now = utcnow()
        n = len(self.busy)
        return [
            BusyBin(start=now - timedelta(seconds=(n - i) * bin_s), seconds=bin_s, busy=b)
            for i, b in enumerate(self.busy)
        ]


class MeteredBackend(ScriptedBackend):
    """A scripted backend that also reports the device's busy time itself."""

    def device_utilization(self, window_s: float, bin_s: float) -> list[BusyBin]:
        return FakeDevice(busy=(1.0,)).device_utilization(window_s, bin_s)


# -- the page and the usage endpoint (no browser) -------------------------------------


def test_page_and_assets_are_served_with_a_strict_policy(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "dashboard/app.js" in page.text and "dashboard/style.css" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    js = client.get("/dashboard/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert client.get("/dashboard/style.css").headers["content-type"].startswith("text/css")
    # only the page's own files: not the module next to them, not a path outside
    for name in ("__init__.py", "index.html", "..%2Fapp.py", "nope.js"):
        assert client.get(f"/dashboard/{name}").status_code == 404, name
    # nothing is loaded from elsewhere
    for text in (page.text, js.text):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text
    assert "/" not in client.get("/openapi.json").json()["paths"]


def test_device_usage_without_a_provider_says_why(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend
) -> None:
    acme = tenants.create("acme")
    globex = tenants.create("globex")
    client.post("/v1/jobs", json=job_body("a", steps=3), headers=acme)
    client.post("/v1/jobs", json=job_body("b", steps=5), headers=globex)
    r = client.get("/v1/usage/device", params={"window_s": 60, "bin_s": 5}, headers=acme)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["source"] is None and body["device"] == []
    assert "ScriptedBackend" in body["device_note"] and "does not report" in body["device_note"]
    # the caller's own steps only, in aligned bins covering the window
    assert sum(p["steps"] for p in body["steps"]) == 3
    assert 12 <= len(body["steps"]) <= 13
    assert all(0 < p["seconds"] <= 5 for p in body["steps"])
    assert (
        sum(p["steps"] for p in client.get("/v1/usage/device", headers=globex).json()["steps"]) == 5
    )


def test_device_usage_reads_the_context_provider(
    client: TestClient, context: ServiceContext, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    context.device_usage = FakeDevice()
    body = client.get("/v1/usage/device", headers=acme).json()
    assert body["source"] == "FakeDevice" and body["device_note"] is None
    assert [p["busy"] for p in body["device"]] == [0.2, 0.55, 0.9, 0.75]
    context.device_usage = FakeDevice(fail=True)
    body = client.get("/v1/usage/device", headers=acme).json()
    assert body["device"] == [] and "the recorder is gone" in body["device_note"]


def test_device_usage_falls_back_to_a_backend_that_reports_it(
    settings: ServiceSettings,
) -> None:
    ctx, _ = open_context(settings)
    with TestClient(create_app(ctx, MeteredBackend().attach)) as client:
        acme = Tenants(client).create("acme")
        body = client.get("/v1/usage/device", headers=acme).json()
        assert body["source"] == "MeteredBackend" and [p["busy"] for p in body["device"]] == [1.0]


def test_device_usage_checks_its_caller_and_its_bins(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    assert client.get("/v1/usage/device").status_code == 401
    assert client.get("/v1/usage/device", headers=ADMIN).status_code == 403
    # A day in bins of a second would be 86400 bins: answered in 2000 bins of 43.2 s
    # (every window and bin width the schema allows is a valid request).
    r = client.get("/v1/usage/device", params={"window_s": 86400, "bin_s": 1}, headers=acme)
    assert r.status_code == 200 and r.json()["bin_s"] == 43.2
    assert len(r.json()["steps"]) <= 2001


def test_recorder_device_usage_bins_the_device_spans() -> None:
    now = [0.0]
    recorder = RunRecorder(clock=lambda: now[0], wall_clock=lambda: 1_000_000.0)
    recorder.span("device", "decode", 0.0, 5.0)
    recorder.span("device", "train", 10.0, 20.0)
    recorder.span("env", "tool", 20.0, 30.0)  # not device work
    now[0] = 30.0
    provider = RecorderDeviceUsage(recorder)
    bins = provider.device_utilization(600, 10)
    assert [(b.start.timestamp(), b.seconds, b.busy) for b in bins] == [
        (1_000_000.0, 10.0, 0.5),
        (1_000_010.0, 10.0, 1.0),
        (1_000_020.0, 10.0, 0.0),
    ]
    # a short window: only its (aligned) bins
    assert [b.busy for b in provider.device_utilization(15, 10)] == [1.0, 0.0]


# -- end to end in Chromium ------------------------------------------------------------


class WithEvals:
    """Wraps the reporter so that every second step also reports an eval accuracy."""

    def __init__(self, inner: JobReporter) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def step(self, job_id: str, step: int, metrics: Mapping[str, float | None]) -> None:
        extra = {"eval_accuracy": 0.1 + 0.1 * step} if step % 2 == 0 else {}
        await self._inner.step(job_id, step, {**metrics, **extra})


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """`app` under uvicorn in a thread, on a free loopback port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("the dashboard's uvicorn server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM_HINT}; CI must run the browser tests", pytrace=False)
        pytest.skip(CHROMIUM_HINT)
    return path


def _playwright() -> Any:
    try:
        from playwright import sync_api
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{PLAYWRIGHT_HINT}; CI must run the browser tests", pytrace=False)
        pytest.skip(PLAYWRIGHT_HINT)
    return sync_api


def _write_adapter(folder: Path) -> None:
    """Stand-in PEFT files, so that the checkpoint can be downloaded."""
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)


@pytest.mark.browser
def test_dashboard_in_chromium(tmp_path: Path) -> None:
    executable = _chromium()
    sync_api = _playwright()
    expect = sync_api.expect

    settings = ServiceSettings(
        data_dir=tmp_path / "data",
        db_url=f"sqlite:///{tmp_path / 'service.db'}",
        admin_key=ADMIN_KEY,
    )
    ctx, _ = open_context(settings)
    backend = ScriptedBackend()
    app = create_app(ctx, lambda reporter: backend.attach(WithEvals(reporter)))  # type: ignore[arg-type]

    with live_server(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        assert http.post("/v1/admin/tenants", json={"name": "acme"}, headers=ADMIN).is_success
        key = http.post("/v1/admin/tenants/acme/keys", json={}, headers=ADMIN).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        alpha = http.post(
            "/v1/jobs", json=job_body("alpha", steps=6, checkpoint_every=2), headers=auth
        ).json()
        backend.hold_at = 3
        beta = http.post(
            "/v1/jobs", json=job_body("beta", steps=8, checkpoint_every=2), headers=auth
        ).json()
        status = [
            http.get(f"/v1/jobs/{j['id']}", headers=auth).json()["status"] for j in (alpha, beta)
        ]
        assert status == ["done", "running"]
        # A training run of a Tinker SDK client (recorded as the Tinker API records one).
        tenant_id = http.get("/v1/me", headers=auth).json()["tenant"]["id"]
        run_id = "ses_0123456789abcdef:train:0"
        TinkerStore(ctx.db, settings.artifact_dir).create_run(
            tenant_id, run_id, "ses_0123456789abcdef", "/base", LoRASpec(rank=4), None
        )

        js_errors: list[str] = []
        policy_errors: list[str] = []
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=executable, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(10_000)
                page.on("pageerror", lambda e: js_errors.append(str(e)))
                page.on(
                    "console",
                    lambda m: (
                        policy_errors.append(m.text)
                        if "Content Security Policy" in m.text
                        else None
                    ),
                )
                page.goto(base + "/")

                # wrong keys: a clear message, still on the sign-in form
                expect(page.locator("#sign-in")).to_be_visible()
                page.fill("#api-key", "mk_000000000000_not-a-real-key")
                page.click("#sign-in-button")
                expect(page.locator("#sign-in-error")).to_contain_text(
                    "This API key was not accepted: invalid API key"
                )
                page.fill("#api-key", ADMIN_KEY)
                page.click("#sign-in-button")
                expect(page.locator("#sign-in-error")).to_contain_text(
                    "cannot open the dashboard: the admin key manages tenants"
                )
                expect(page.locator("#dashboard")).to_be_hidden()
                assert page.evaluate("localStorage.getItem('marlaas.apiKey')") is None
                page.screenshot(path=str(tmp_path / "sign-in.png"))

                # the right key: the jobs table
                page.fill("#api-key", key)
                page.click("#sign-in-button")
                expect(page.locator("#sign-in")).to_be_hidden()
                expect(page.locator("#tenant-name")).to_have_text("acme")
                rows = page.locator("#jobs tbody tr")
                expect(rows).to_have_count(2)
                row_a = page.locator(f'#jobs tr[data-job-id="{alpha["id"]}"]')
                row_b = page.locator(f'#jobs tr[data-job-id="{beta["id"]}"]')
                expect(row_a.locator(".status")).to_have_text("done")
                expect(row_a.locator(".steps")).to_contain_text("6 / 6")
                expect(row_a.locator(".reward")).to_have_text("0.600")
                expect(row_a.locator(".eval")).to_have_text("70.0%")
                expect(row_b.locator(".status")).to_have_text("running")
                expect(row_b.locator(".steps")).to_contain_text("3 / 8")
                expect(row_b.locator(".eval")).to_have_text("30.0%")
                tinker = page.locator(f'#tinker-runs tr[data-run-id="{run_id}"]')
                expect(page.locator("#tinker-card")).to_be_visible()
                expect(tinker.locator("td.num")).to_have_text("4")

                # the newest job is selected first: its curves and checkpoints
                expect(page.locator("#detail-name")).to_have_text("beta")
                expect(page.locator("#chart-reward svg")).to_have_attribute("data-points", "3")
                expect(page.locator("#chart-eval svg")).to_have_attribute("data-points", "1")
                expect(page.locator("#checkpoints a.download")).to_have_count(1)

                # device: no figure from this backend, said plainly; steps are known
                expect(page.locator("#chart-device .no-data")).to_contain_text(
                    "No data: device utilization is not available"
                )
                expect(page.locator("#chart-steps svg rect")).not_to_have_count(0)

                # the backend starts reporting, beta runs to the end: the page follows
                # by itself
                ctx.device_usage = FakeDevice()
                assert http.post(f"/v1/jobs/{beta['id']}/pause", headers=auth).is_success
                assert http.post(f"/v1/jobs/{beta['id']}/resume", headers=auth).is_success
                expect(row_b.locator(".status")).to_have_text("done")
                expect(row_b.locator(".steps")).to_contain_text("8 / 8")
                expect(page.locator("#chart-device svg")).to_have_attribute("data-points", "4")
                expect(page.locator("#device-source")).to_contain_text("FakeDevice")
                expect(page.locator("#chart-reward svg")).to_have_attribute("data-points", "8")
                expect(page.locator("#chart-eval svg")).to_have_attribute("data-points", "4")
                expect(page.locator("#chart-eval svg circle")).to_have_count(4)
                expect(page.locator("#checkpoints a.download")).to_have_count(4)

                # alpha: click to select; links to each checkpoint's adapter
                row_a.click()
                expect(page.locator("#detail-name")).to_have_text("alpha")
                links = page.locator("#checkpoints a.download")
                expect(links).to_have_count(3)
                hrefs = [links.nth(i).get_attribute("href") for i in range(3)]
                assert hrefs == [
                    f"v1/jobs/{alpha['id']}/checkpoints/{s}/adapter" for s in (2, 4, 6)
                ]
                expect(page.locator("#chart-reward svg")).to_have_attribute("data-points", "6")
                expect(page.locator("#chart-eval svg")).to_have_attribute("data-points", "3")
                screenshot = tmp_path / "dashboard.png"
                page.screenshot(path=str(screenshot), full_page=True)
                print(f"dashboard screenshots: {screenshot}, {tmp_path / 'sign-in.png'}")

                # a download with the key; a missing adapter says so in the page
                _write_adapter(settings.artifact_dir / "checkpoints" / alpha["id"] / "step-6")
                with page.expect_download() as info:
                    page.locator('#checkpoints a.download[data-step="6"]').click()
                download = info.value
                assert download.suggested_filename == "alpha-step-6.tar.gz"
                saved = tmp_path / download.suggested_filename
                download.save_as(saved)
                with tarfile.open(saved) as tar:
                    files = sorted(m.name for m in tar.getmembers() if m.isfile())
                    assert files == [
                        "alpha-step-6/adapter_config.json",
                        "alpha-step-6/adapter_model.safetensors",
                    ]
                page.locator('#checkpoints a.download[data-step="2"]').click()
                expect(page.locator("#error")).to_contain_text(
                    "Download of the step-2 adapter of alpha failed: the adapter files"
                )

                # a supervised job: its first chart is the training loss, not a reward
                chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
                rows = "".join(json.dumps({"messages": chat}) + "\n" for _ in range(8))
                r = http.put("/v1/datasets/chats", content=rows.encode(), headers=auth)
                assert r.status_code == 201, r.text
                sft = {
                    "name": "gamma",
                    "task": {"type": "dataset", "path": "chats"},
                    "algorithm": {"type": "sft", "batch_size": 2},
                    "steps": 4,
                }
                backend.hold_at = None  # it runs to the end
                r = http.post("/v1/jobs", json=sft, headers=auth)
                assert r.status_code == 201, r.text
                row_c = page.locator(f'#jobs tr[data-job-id="{r.json()["id"]}"]')
                expect(row_c.locator(".status")).to_have_text("done")
                row_c.click()
                expect(page.locator("#detail-name")).to_have_text("gamma")
                expect(page.locator("#caption-reward")).to_have_text("Training loss per step")
                expect(page.locator("#caption-eval")).to_have_text("Eval token accuracy")
                expect(page.locator("#chart-reward svg")).to_have_attribute("data-points", "4")
                row_a.click()
                expect(page.locator("#caption-reward")).to_have_text("Reward per step")

                # the key survives a reload; signing out forgets it
                page.reload()
                expect(page.locator("#jobs tbody tr")).to_have_count(3)
                page.click("#sign-out")
                expect(page.locator("#sign-in")).to_be_visible()
                expect(page.locator("#dashboard")).to_be_hidden()
                assert page.evaluate("localStorage.getItem('marlaas.apiKey')") is None
            finally:
                browser.close()

    assert screenshot.stat().st_size > 10_000
    assert js_errors == [], js_errors
    assert policy_errors == [], policy_errors
