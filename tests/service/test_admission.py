"""Admission by cost: a job that is out of bounds, cannot fit the machine, cannot start
or would ask more than its tenant's quotas is refused at submission (422 / 429 naming
the field and the limit), and nothing is stored. Every case here was accepted (201)
before, and failed or hung only once the job ran."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from helpers.service_support import ADMIN, ScriptedBackend, Tenants, job_body
from marlaas.service.admission import JobCost
from marlaas.service.app import create_app, open_context
from marlaas.service.settings import ServiceSettings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _problem(r: Any) -> tuple[list[Any], str]:
    detail = r.json()["detail"]
    assert isinstance(detail, list), detail
    return detail[0]["loc"], " ".join(d["msg"] for d in detail)


def _refused(client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> Any:
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code in (422, 429), r.text
    assert client.get("/v1/jobs", headers=headers).json()["jobs"] == []  # nothing stored
    return r


@pytest.mark.parametrize(
    ("extra", "loc", "words"),
    [
        ({"algorithm": {"group_size": 1_000_000}}, "group_size", "1024"),
        ({"algorithm": {"prompts_per_step": 1_000_000}}, "prompts_per_step", "1024"),
        ({"eval_episodes": 100_000}, "eval_episodes", "10000"),
        ({"seed": 2**70}, "seed", "9223372036854775807"),
        ({"task": {"family": "calculator", "tool_latency_s": [1e9, 1e9]}}, "tool_latency_s", "60"),
        ({"steps": True}, "steps", "integer"),
        ({"name": "job\n"}, "name", "letters, digits"),
        ({"sampling": {"stop": ["x"] * 17}}, "stop", "16"),
    ],
)
def test_out_of_bounds_specs_are_refused(
    client: TestClient, tenants: Tenants, extra: dict[str, Any], loc: str, words: str
) -> None:
    acme = tenants.create("acme")
    body = {**job_body(), **extra}
    if "task" in extra:
        body["task"] = extra["task"]
    r = _refused(client, acme, body)
    assert r.status_code == 422
    where, message = _problem(r)
    assert loc in [str(p) for p in where], where
    assert words in message, message


def test_infinity_in_the_json_body_is_refused(client: TestClient, tenants: Tenants) -> None:
    """Python's JSON reader takes `Infinity`; the spec does not."""
    acme = tenants.create("acme")
    raw = (
        b'{"name": "j", "task": {"family": "arithmetic"}, "algorithm": {"learning_rate": Infinity}}'
    )
    r = client.post("/v1/jobs", content=raw, headers={**acme, "content-type": "application/json"})
    assert r.status_code == 422 and "learning_rate" in str(r.json()["detail"][0]["loc"])


def test_tool_latency_range_is_taken_in_either_order(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    body = {**job_body(), "task": {"family": "calculator", "tool_latency_s": [0.2, 0.1]}}
    r = client.post("/v1/jobs", json=body, headers=acme)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["task"]["tool_latency_s"] == [0.1, 0.2]


def test_unknown_target_modules_are_refused_with_the_models_own_list(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    r = _refused(client, acme, {**job_body(), "lora": {"target_modules": ["q_proj", "nope"]}})
    where, message = _problem(r)
    assert where == ["body", "lora", "target_modules"]
    assert "nope" in message and "q_proj" in message and "v_proj" in message


@pytest.mark.parametrize(
    ("quota", "value", "extra", "asked"),
    [
        ("max_samples_per_step", 16, {"algorithm": {"group_size": 8, "prompts_per_step": 4}}, 32),
        ("max_eval_episodes", 10, {"eval_episodes": 64}, 64),
        ("max_tokens_per_step", 100, {}, None),
    ],
)
def test_a_job_above_its_tenants_cost_quotas_is_refused_with_429(
    client: TestClient,
    tenants: Tenants,
    quota: str,
    value: int,
    extra: dict[str, Any],
    asked: int | None,
) -> None:
    acme = tenants.create("acme", **{quota: value})
    r = _refused(client, acme, {**job_body(), **extra})
    assert r.status_code == 429
    detail = r.json()["detail"]
    assert f"quota {quota} exceeded" in detail and f"at most {value}" in detail
    if asked is not None:
        assert f"asks for {asked}" in detail
    # the admin raises it: the same job fits
    patch = client.patch(
        "/v1/admin/tenants/acme/quotas", json={quota: 10_000}, headers=ADMIN
    ).json()
    assert patch["quotas"][quota] == 10_000
    assert client.post("/v1/jobs", json={**job_body(), **extra}, headers=acme).status_code == 201


def test_tokens_per_step_count_the_longest_prompt_and_every_turn() -> None:
    cost = JobCost(
        samples_per_step=32,
        eval_episodes=8,
        longest_prompt=20,
        max_turns=3,
        max_new_tokens=48,
        context_length=256,
    )
    assert cost.tokens_per_sequence == 20 + 3 * 48
    assert cost.tokens_per_step == 32 * (20 + 3 * 48)
    capped = JobCost(32, 8, 200, 3, 48, context_length=256)
    assert capped.tokens_per_sequence == 256  # the engine stops at the context


def test_machine_limits_come_from_the_engine_and_the_model(
    settings: ServiceSettings, backend: ScriptedBackend
) -> None:
    """A group larger than the engine's rows, a turn beyond the model's context (the
    embedded base has 256 positions) and a sequence beyond the trainer's budget."""
    small = settings.model_copy(update={"max_batch_rows": 4, "max_tokens_per_microbatch": 128})
    ctx, _ = open_context(small)
    with TestClient(create_app(ctx, backend.attach)) as client:
        acme = Tenants(client).create("acme")
        r = _refused(client, acme, {**job_body(), "algorithm": {"group_size": 8}})
        where, message = _problem(r)
        assert where[-1] == "group_size" and "4 engine rows" in message
        four = {"group_size": 4}
        r = _refused(
            client, acme, {**job_body(), "algorithm": four, "sampling": {"max_new_tokens": 4000}}
        )
        where, message = _problem(r)
        assert where[-1] == "max_new_tokens" and "context of 256 tokens" in message
        r = _refused(
            client, acme, {**job_body(), "algorithm": four, "sampling": {"max_new_tokens": 200}}
        )
        where, message = _problem(r)
        assert where[-1] == "max_new_tokens" and "budget of 128 tokens" in message
        ok = {**job_body(), "algorithm": {"group_size": 4}, "sampling": {"max_new_tokens": 16}}
        assert client.post("/v1/jobs", json=ok, headers=acme).status_code == 201


def test_a_family_option_out_of_its_range_is_refused(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    body = {**job_body(), "task": {"family": "arithmetic", "options": {"max_digits": 50}}}
    where, message = _problem(_refused(client, acme, body))
    assert where == ["body", "task", "options"] and "max_digits" in message


def _upload(client: TestClient, headers: dict[str, str], name: str, text: str) -> None:
    r = client.put(f"/v1/datasets/{name}", content=text.encode(), headers=headers)
    assert r.status_code == 201, r.text


def _dataset_job(name: str, **task: Any) -> dict[str, Any]:
    return {
        "name": "dj",
        "task": {"type": "dataset", "path": name, "grader": {"type": "exact"}, **task},
        "steps": 2,
        "eval_episodes": 2,
    }


def test_dataset_rows_are_checked_before_201_without_server_paths(
    client: TestClient, tenants: Tenants, context: Any
) -> None:
    acme = tenants.create("acme")
    rows = "".join(f'{{"prompt": "Q: {i}\\nA: ", "reference": "{i}"}}\n' for i in range(5))
    _upload(client, acme, "good", rows + '{"question": "no prompt", "reference": "x"}\n')
    where, message = _problem(_refused(client, acme, _dataset_job("good")))
    assert where == ["body", "task", "path"]
    assert "dataset 'good', line 6" in message and "'prompt'" in message
    assert str(context.settings.data_dir) not in message and "/" not in message.split("line")[0]
    # a field that no row has
    _upload(client, acme, "plain", rows)
    where, message = _problem(_refused(client, acme, _dataset_job("plain", prompt_field="q")))
    assert where == ["body", "task", "path"] and "'q'" in message
    assert client.post("/v1/jobs", json=_dataset_job("plain"), headers=acme).status_code == 201


def test_a_dataset_prompt_longer_than_the_context_is_refused(
    client: TestClient, tenants: Tenants
) -> None:
    acme = tenants.create("acme")
    rows = "".join(f'{{"prompt": "Q: {i}", "reference": "{i}"}}\n' for i in range(5))
    _upload(
        client,
        acme,
        "long",
        rows + '{"id": "big", "prompt": "' + "x" * 300 + '", "reference": "y"}\n',
    )
    where, message = _problem(_refused(client, acme, _dataset_job("long")))
    assert where == ["body", "task"]
    assert "'big'" in message and "300 tokens" in message and "256" in message


def test_names_with_a_trailing_newline_are_refused(client: TestClient, tenants: Tenants) -> None:
    acme = tenants.create("acme")
    r = client.post("/v1/admin/tenants", json={"name": "evil\n"}, headers=ADMIN)
    assert r.status_code == 422
    r = client.put(
        "/v1/datasets/d%0A", content=b'{"prompt": "a", "reference": "b"}\n', headers=acme
    )
    assert r.status_code == 422
    assert client.get("/v1/datasets", headers=acme).json()["datasets"] == []


@pytest.mark.parametrize("value", [True, 2.5, "3", -1, 10**30])
def test_quota_patches_take_integers_only(
    client: TestClient, tenants: Tenants, value: object
) -> None:
    tenants.create("acme")
    r = client.patch(
        "/v1/admin/tenants/acme/quotas", json={"max_concurrent_jobs": value}, headers=ADMIN
    )
    assert r.status_code == 422, r.text
    quotas = client.get("/v1/admin/tenants/acme", headers=ADMIN).json()["quotas"]
    assert quotas["max_concurrent_jobs"] == 3  # unchanged (the test settings' default)


def test_a_job_stored_before_todays_bounds_is_still_listed(
    client: TestClient, tenants: Tenants, context: Any
) -> None:
    """An older server took `group_size: 1000000`; reading the job must not fail (the
    pipeline backend fails such a job at its next start)."""
    from marlaas.service.models import Job

    acme = tenants.create("acme")
    jid = client.post("/v1/jobs", json=job_body(), headers=acme).json()["id"]
    with context.db.transaction() as session:
        job = session.get(Job, jid)
        job.spec = {**job.spec, "algorithm": {**job.spec["algorithm"], "group_size": 1_000_000}}
    for r in (client.get(f"/v1/jobs/{jid}", headers=acme), client.get("/v1/jobs", headers=acme)):
        assert r.status_code == 200, r.text
    shown = client.get(f"/v1/jobs/{jid}", headers=acme).json()["spec"]
    assert shown["algorithm"]["group_size"] == 1_000_000


def test_failure_reasons_do_not_show_server_paths(
    client: TestClient, tenants: Tenants, backend: ScriptedBackend, context: Any
) -> None:
    import asyncio

    from marlaas.service.lifecycle import JobStatus

    acme = tenants.create("acme")
    backend.hold_at = 1
    jid = client.post("/v1/jobs", json=job_body(), headers=acme).json()["id"]
    where = context.settings.artifact_dir.resolve() / "datasets" / "ten_x" / "ds_1.jsonl"
    assert backend.reporter is not None
    asyncio.run(backend.reporter.status(jid, JobStatus.FAILED, f"DataError: {where}:3: bad row"))
    reason = client.get(f"/v1/jobs/{jid}", headers=acme).json()["failure_reason"]
    assert reason == "DataError: .../ds_1.jsonl:3: bad row"
    r = client.get(f"/v1/jobs/{jid}/events", params={"follow": "false"}, headers=acme)
    assert str(context.settings.data_dir) not in r.text


def test_targets_and_formats_are_checked_against_the_served_model(
    client: TestClient, tenants: Tenants
) -> None:
    """LoRA targets are resolved with the model's own layers ('all-linear' and its leaf
    names pass, another architecture's names do not), and a chat task needs a chat
    template, which the embedded base lacks."""
    acme = tenants.create("acme")
    for i, targets in enumerate(("all-linear", ["q_proj", "down_proj"])):
        body = {**job_body(f"ok{i}"), "lora": {"target_modules": targets}}
        assert client.post("/v1/jobs", json=body, headers=acme).status_code == 201
    gpt2 = {**job_body("gpt2"), "lora": {"target_modules": ["c_attn"]}}
    where, message = _problem(_refused_among(client, acme, gpt2))
    assert where == ["body", "lora", "target_modules"] and "c_attn" in message
    chat = {**job_body("chat"), "task": {"family": "arithmetic", "format": "chat"}}
    where, message = _problem(_refused_among(client, acme, chat))
    assert where == ["body", "task", "format"] and "chat template" in message


def _refused_among(client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> Any:
    """`_refused` for a tenant that has jobs already: the job is not among them."""
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 422, r.text
    names = [j["name"] for j in client.get("/v1/jobs", headers=headers).json()["jobs"]]
    assert body["name"] not in names
    return r


def test_the_servers_default_targets_apply_to_jobs_that_name_none(
    settings: ServiceSettings, backend: ScriptedBackend
) -> None:
    """`marlaas serve --target-modules` (`default_target_modules`): a job without
    `lora.target_modules` is checked with the server's default, so a default the base
    lacks refuses it, naming the field; a job naming its own targets passes."""
    odd = settings.model_copy(update={"default_target_modules": ("c_attn",)})
    ctx, _ = open_context(odd)
    with TestClient(create_app(ctx, backend.attach)) as client:
        acme = Tenants(client).create("acme")
        where, message = _problem(_refused(client, acme, job_body()))
        assert where == ["body", "lora", "target_modules"] and "c_attn" in message
        own = {**job_body(), "lora": {"target_modules": ["q_proj"]}}
        assert client.post("/v1/jobs", json=own, headers=acme).status_code == 201
