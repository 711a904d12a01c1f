"""What the Tinker API keeps across restarts: runs and saved weights in the database,
owned by one tenant (404 for the others), counted in its quotas, and their files
(saved states round-trip exactly; sampler weights are a PEFT directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlaas.config.specs import LoRASpec
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.service import quotas
from marlaas.service.db import Database
from marlaas.service.errors import NotFound, QuotaExceeded
from marlaas.service.models import Tenant, utcnow
from marlaas.service.settings import QuotaSpec
from marlaas.service.tinker import state_io
from marlaas.service.tinker.errors import UserError
from marlaas.service.tinker.paths import TinkerPath, model_id, new_session_id
from marlaas.service.tinker.store import ACTIVE, CLOSED, TinkerStore
from marlaas.train.optim import AdamState, TenantSnapshot

LORA = LoRASpec(rank=2, alpha=32.0, target_modules=("q_proj", "v_proj"))


def _tenant(db: Database, tid: str, steps: int = 100, jobs: int = 3) -> None:
    with db.transaction() as session:
        session.add(
            Tenant(
                id=tid,
                name=tid,
                created_at=utcnow(),
                **QuotaSpec(
                    max_concurrent_jobs=jobs, max_total_steps=steps, max_dataset_bytes=1000
                ).model_dump(),
            )
        )


@pytest.fixture
def store(db_url: str, tmp_path: Path) -> TinkerStore:
    db = Database(db_url)
    _tenant(db, "ten_a", steps=2)
    _tenant(db, "ten_b")
    return TinkerStore(db, tmp_path / "artifacts")


def test_runs_are_the_owners_and_count_in_its_quotas(store: TinkerStore) -> None:
    run = model_id(new_session_id(), 0)
    record = store.create_run("ten_a", run, "ses_x", "/base", LORA, {"exp": "1"})
    assert (record.status, record.lora, record.tenant_name) == (ACTIVE, LORA, "ten_a")
    with pytest.raises(NotFound):
        store.run("ten_b", run)
    with store.db.transaction() as session:
        assert quotas.usage(session, "ten_a").active_jobs == 1
    store.reserve_step("ten_a", run)
    store.reserve_step("ten_a", run)
    with pytest.raises(QuotaExceeded, match="max_total_steps"):
        store.reserve_step("ten_a", run)  # its limit is 2
    store.release_step(run)
    assert store.run("ten_a", run).steps == 1
    assert store.close_all() == 1
    assert store.run("ten_a", run).status == CLOSED
    with store.db.transaction() as session:
        used = quotas.usage(session, "ten_a")
        assert (used.active_jobs, used.total_steps) == (0, 1)  # steps stay counted


def test_runs_beyond_the_concurrent_jobs_quota_are_refused(db_url: str, tmp_path: Path) -> None:
    db = Database(db_url)
    _tenant(db, "ten_c", jobs=1)
    store = TinkerStore(db, tmp_path)
    store.create_run("ten_c", model_id(new_session_id(), 0), "s", "/base", LORA, None)
    with pytest.raises(QuotaExceeded, match="max_concurrent_jobs"):
        store.create_run("ten_c", model_id(new_session_id(), 0), "s", "/base", LORA, None)


def test_checkpoints_are_listed_replaced_and_deleted_for_their_owner(store: TinkerStore) -> None:
    run = model_id(new_session_id(), 1)
    store.create_run("ten_a", run, "s", "/base", LORA, None)
    path = TinkerPath(run, "sampler", "step-1")
    with pytest.raises(NotFound):
        store.checkpoint("ten_a", path)
    store.directory("ten_a", path).mkdir(parents=True)
    store.add_checkpoint("ten_a", path, 10, 1, {"note": "first"}, None)
    store.check_free("ten_a", path, overwrite=True)
    with pytest.raises(UserError, match="overwrite=True"):
        store.check_free("ten_a", path, overwrite=False)
    store.add_checkpoint("ten_a", path, 20, 2, None, 7200)  # replaces the row
    (only,) = store.checkpoints("ten_a", run)
    assert (only.size_bytes, only.version, only.expires_at is not None) == (20, 2, True)
    assert store.checkpoints("ten_b") == []
    with pytest.raises(NotFound):
        store.checkpoint("ten_b", path)  # another tenant's path: as if missing
    with pytest.raises(NotFound):
        store.add_checkpoint("ten_b", TinkerPath(run, "sampler", "x"), 1, 0, None, None)
    with pytest.raises(UserError, match="ttl_seconds"):
        store.add_checkpoint("ten_a", path, 1, 0, None, 60)
    store.delete_checkpoint("ten_a", path)
    assert store.checkpoints("ten_a") == [] and not store.directory("ten_a", path).exists()


def test_saved_states_round_trip_and_sampler_weights_are_peft(tmp_path: Path) -> None:
    base, _ = load_base(default_base_path())
    model = LoRAModel(base, max_rank=4)
    tensors = {
        p: (a + 0.1 * torch.randn_like(a), torch.randn_like(b))
        for p, (a, b) in model.init_adapter(LORA, 0).items()
    }
    flat = torch.cat([t.reshape(-1) for pair in tensors.values() for t in pair])
    adam = AdamState(step=5, exp_avg_P=torch.randn_like(flat), exp_avg_sq_P=torch.rand_like(flat))
    snap = TenantSnapshot("tinker:a", LORA, 5, tensors, adam)
    size = state_io.write_state(tmp_path / "state", snap, "/base")
    assert size > 0 and sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "adapter",
        "optimizer.safetensors",
        "state.json",
    ]
    back = state_io.read_state(tmp_path / "state", model, "tinker:b", optimizer=True)
    assert (back.tenant, back.version, back.lora) == ("tinker:b", 5, LORA)
    assert back.adam is not None and back.adam.step == 5
    torch.testing.assert_close(back.adam.exp_avg_P, adam.exp_avg_P)
    for p, (a, b) in tensors.items():
        torch.testing.assert_close(back.tensors[p][0], a)
        torch.testing.assert_close(back.tensors[p][1], b)
    fresh = state_io.read_state(tmp_path / "state", model, "t", optimizer=False)
    assert fresh.adam is None and fresh.version == 5
    # A state saved with the tenant RNG state older code wrote still reads.
    optimizer = tmp_path / "state" / state_io.OPTIMIZER_NAME
    flat = load_file(str(optimizer))
    assert set(flat) == {"exp_avg", "exp_avg_sq"}
    save_file({**flat, "rng_state": torch.Generator().manual_seed(3).get_state()}, str(optimizer))
    old = state_io.read_state(tmp_path / "state", model, "tinker:c", optimizer=True)
    assert old.adam is not None and old.adam.step == 5 and old.version == 5
    torch.testing.assert_close(old.adam.exp_avg_sq_P, adam.exp_avg_sq_P)

    state_io.write_sampler_weights(tmp_path / "sampler", LORA, tensors, "/base")
    assert sorted(p.name for p in (tmp_path / "sampler").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    spec, loaded = state_io.read_adapter(tmp_path / "sampler", model)
    assert spec.rank == 2 and set(loaded) == set(tensors)
    _, from_state = state_io.read_adapter(tmp_path / "state", model)
    torch.testing.assert_close(from_state[next(iter(tensors))][1], next(iter(tensors.values()))[1])
    state_io.remove(tmp_path / "sampler")
    assert not (tmp_path / "sampler").exists()
