"""`Client`: the job API from Python, over httpx.

    from marlaas.client import Client

    with Client("http://127.0.0.1:8321", api_key="mk_...") as mc:
        job = mc.submit("job.yaml")
        final = mc.wait(job.id, progress=print)
        mc.download(job.id, "my-adapter")  # a PEFT directory

Every method raises a `marlaas.client.errors.ClientError` (a `MarlaasError`) carrying
the server's message; nothing returns an error value. Event streams reconnect on their
own after a cut, resuming after the last event seen, so `events` and `wait` see each
event exactly once.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx

from marlaas.client import sse
from marlaas.client.download import unpack
from marlaas.client.errors import ClientError, ConnectionFailed, ServerError, api_error
from marlaas.client.specs import load_job_specs
from marlaas.client.types import Checkpoint, Job, JobEvent, MetricPoint
from marlaas.config.job import JobSpec

URL_ENV = "MARLAAS_URL"
KEY_ENV = "MARLAAS_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8321"

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ArchiveFormat = Literal["tar.gz", "zip"]
EventCallback = Callable[[JobEvent], None]
BytesCallback = Callable[[int, int | None], None]
"""Called with (bytes received so far, total bytes or None when unknown)."""


@dataclass(frozen=True)
class Downloaded:
    """A downloaded adapter: the PEFT directory and the checkpoint step it came from."""

    path: Path
    step: int


class Client:
    """A tenant's handle on a marlaas server. `base_url` and `api_key` default to
    $MARLAAS_URL (else http://127.0.0.1:8321) and $MARLAAS_API_KEY."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        stream_timeout: float = 60.0,
        max_reconnects: int = 5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        url = (base_url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ClientError(f"server URL {url!r} must start with http:// or https://")
        key = api_key or os.environ.get(KEY_ENV)
        if not key:
            raise ClientError(f"no API key: pass one (--key / api_key=) or set ${KEY_ENV}")
        self.base_url = url
        self.max_reconnects = max_reconnects
        self._stream_timeout = httpx.Timeout(timeout, read=stream_timeout)
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
            transport=transport,
        )

    # -- plumbing ------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _unreachable(self, error: Exception) -> ConnectionFailed:
        return ConnectionFailed(
            f"cannot reach the marlaas server at {self.base_url} ({error or type(error).__name__}); "
            f"is `marlaas serve` running there? Set --url or ${URL_ENV}"
        )

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.is_success:
            return
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        raise api_error(response.status_code, body, response.reason_phrase)

    @staticmethod
    def _job_path(job_id: str, suffix: str = "") -> str:
        if not _JOB_ID.match(job_id):
            raise ClientError(
                f"{job_id[:80]!r} is not a job id (they look like job_3f9a0c...); "
                "list your jobs to find it"
            )
        return f"/v1/jobs/{job_id}{suffix}"

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        self._raise_for(response)
        return response

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise ServerError(
                response.status_code, f"the server answered {path} with something not JSON"
            ) from None

    # -- jobs ----------------------------------------------------------------------

    def submit(self, spec: JobSpec | Mapping[str, Any] | str | Path) -> Job:
        """Create a job from a `JobSpec`, a mapping, or a YAML/JSON file holding one job
        (a file with several jobs: `load_job_specs` and submit each)."""
        if isinstance(spec, str | Path):
            specs = load_job_specs(spec)
            if len(specs) != 1:
                raise ClientError(
                    f"{spec} holds {len(specs)} jobs; submit them one by one "
                    "(marlaas.client.load_job_specs reads them all)"
                )
            spec = specs[0]
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        return Job.model_validate(self._call("POST", "/v1/jobs", json=body))

    def jobs(self, status: str | None = None, limit: int = 100, offset: int = 0) -> list[Job]:
        """Your jobs, newest first (optionally only those in `status`)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status is not None:
            params["status"] = status
        answer = self._call("GET", "/v1/jobs", params=params)
        return [Job.model_validate(j) for j in answer["jobs"]]

    def job(self, job_id: str) -> Job:
        return Job.model_validate(self._call("GET", self._job_path(job_id)))

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._call("POST", self._job_path(job_id, "/cancel")))

    def pause(self, job_id: str) -> Job:
        return Job.model_validate(self._call("POST", self._job_path(job_id, "/pause")))

    def resume(self, job_id: str) -> Job:
        return Job.model_validate(self._call("POST", self._job_path(job_id, "/resume")))

    def delete_job(self, job_id: str) -> None:
        """Delete a done, failed or cancelled job for good (cancel an active one first):
        the server removes its checkpoints and adapters, and the job is gone (`job`
        and the rest raise `NotFoundError` afterwards). The steps it used still count toward
        your quota; an uploaded dataset it trained on is kept."""
        self._send("DELETE", self._job_path(job_id))

    def metrics(
        self,
        job_id: str,
        names: list[str] | None = None,
        since_step: int = 0,
        until_step: int | None = None,
    ) -> list[MetricPoint]:
        """The job's scalars per step, ordered by step then name."""
        params: dict[str, Any] = {"since_step": since_step}
        if names:
            params["name"] = names
        if until_step is not None:
            params["until_step"] = until_step
        answer = self._call("GET", self._job_path(job_id, "/metrics"), params=params)
        return [MetricPoint.model_validate(p) for p in answer["points"]]

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        """The job's checkpoints with their metrics, oldest first."""
        answer = self._call("GET", self._job_path(job_id, "/checkpoints"))
        return [Checkpoint.model_validate(c) for c in answer["checkpoints"]]

    # -- events --------------------------------------------------------------------

    def _stream(self, job_id: str, after: int, follow: bool) -> Iterator[JobEvent | None]:
        """Events after `after`, and None for each heartbeat; reconnects after a cut."""
        failures = 0
        while True:
            try:
                with self._http.stream(
                    "GET",
                    self._job_path(job_id, "/events"),
                    params={"after": after, "follow": follow},
                    headers={"Accept": "text/event-stream"},
                    timeout=self._stream_timeout,
                ) as response:
                    if not response.is_success:
                        response.read()
                        self._raise_for(response)
                    for message in sse.parse(response.iter_lines()):
                        if message.event is None:
                            yield None
                        elif message.event == "end":
                            return
                        elif message.id is not None:
                            event = JobEvent.model_validate_json(message.data)
                            after, failures = event.id, 0
                            yield event
            except httpx.TransportError as e:
                failures += 1
                if failures > self.max_reconnects:
                    raise self._unreachable(e) from e
                time.sleep(min(0.2 * 2**failures, 5.0))
            # The stream stopped without `end`: the server cut it on purpose (or the
            # connection broke); resume after the last event seen.

    def events(self, job_id: str, after: int = 0, follow: bool = True) -> Iterator[JobEvent]:
        """The job's events after event id `after`, in order. `follow`: keep waiting for
        new ones until the job is done, failed or cancelled; otherwise stop at the
        newest one now."""
        for event in self._stream(job_id, after, follow):
            if event is not None:
                yield event

    def wait(
        self,
        job_id: str,
        progress: EventCallback | None = None,
        timeout: float | None = None,
    ) -> Job:
        """Block until the job is done, failed or cancelled and return it; `progress` is
        called with every event on the way (the history first). `timeout` (seconds):
        raise `TimeoutError` (a `ClientError`) if the job is still going then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in self._stream(job_id, 0, True):
            if event is not None and progress is not None:
                progress(event)
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"job {job_id} is still running after {timeout:g} s")
        return self.job(job_id)

    # -- adapters ------------------------------------------------------------------

    def download(
        self,
        job_id: str,
        dest: str | Path,
        version: int | None = None,
        *,
        fmt: ArchiveFormat = "tar.gz",
        progress: BytesCallback | None = None,
        overwrite: bool = False,
    ) -> Downloaded:
        """Save the adapter of the job's checkpoint at step `version` (None: the newest,
        i.e. the final adapter of a finished job) as a PEFT directory at `dest`, which
        `peft.PeftModel.from_pretrained(base, dest)` loads."""
        target = Path(dest)
        occupied = target.exists() and (not target.is_dir() or any(target.iterdir()))
        if occupied and not overwrite:
            raise ClientError(
                f"{target} already exists; choose another destination or overwrite it"
            )
        if fmt not in ("tar.gz", "zip"):
            raise ClientError(f"archive format must be 'tar.gz' or 'zip', got {fmt!r}")
        path = (
            self._job_path(job_id, "/adapter")
            if version is None
            else self._job_path(job_id, f"/checkpoints/{version}/adapter")
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".marlaas-download-", dir=target.parent))
        try:
            archive = work / f"adapter.{fmt}"
            step = self._fetch(path, fmt, archive, progress)
            folder = unpack(archive, fmt, work / "adapter")
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            os.replace(folder, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return Downloaded(path=target, step=step)

    def _fetch(self, path: str, fmt: str, archive: Path, progress: BytesCallback | None) -> int:
        try:
            with self._http.stream(
                "GET", path, params={"format": fmt}, timeout=self._stream_timeout
            ) as response:
                if not response.is_success:
                    response.read()
                    self._raise_for(response)
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                received = 0
                with open(archive, "wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                        received += len(chunk)
                        if progress is not None:
                            progress(received, total)
                step = response.headers.get("X-Marlaas-Step", "")
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        if not step.isdigit():
            raise ServerError(200, f"the server's answer to {path} names no checkpoint step")
        return int(step)


class WaitTimeout(ClientError, TimeoutError):
    """`Client.wait` gave up: the job was still going at the timeout."""
