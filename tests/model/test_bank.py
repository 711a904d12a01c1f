"""The adapter bank: slots, LRU paging, versions and pins, spilling, capacity."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from marlaas.config.specs import LoRASpec
from marlaas.errors import CapacityError, ModelError, TenantNotFound
from marlaas.model.bank import AdapterBank, AdapterHandle
from marlaas.model.base import load_base
from marlaas.model.lora import AdapterTensors, LoRAModel

MakeAdapter = Callable[[LoRAModel, LoRASpec, int], AdapterTensors]
SMALL = LoRASpec(rank=4, alpha=8.0)
#: A full-rank adapter of every module, and one of rank 2 on the queries only.
FULL, QUERIES = LoRASpec(rank=8), LoRASpec(rank=2, alpha=2.0, target_modules=("q_proj",))
QUERY_PATHS = {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoRAModel:
    base, _ = load_base(tiny_llama_dir)
    return LoRAModel(base, max_rank=8)


def _slot_holds(bank: AdapterBank, handle: AdapterHandle, tensors: AdapterTensors) -> bool:
    """The slot's buffers hold exactly `tensors` (B times the scale), zero-padded, and
    zeros elsewhere."""
    lanes = bank.slot_lanes(torch.tensor([handle.slot]))
    assert lanes.prescaled
    r = handle.spec.rank
    for path, A_Lri in bank._A.items():
        A_ri, B_or = A_Lri[handle.slot], bank._B[path][handle.slot]
        if path in tensors:
            want_A, want_B = tensors[path]
            want_B = want_B * handle.spec.scaling
            if not (torch.equal(A_ri[:r], want_A) and torch.equal(B_or[:, :r], want_B)):
                return False
            if A_ri[r:].any() or B_or[:, r:].any():
                return False
        elif A_ri.any() or B_or.any():
            return False
    return float(lanes.scale_L[handle.slot]) == pytest.approx(handle.spec.scaling)


def test_slot_forward_equals_direct_lanes(model: LoRAModel, make_adapter: MakeAdapter) -> None:
    bank = AdapterBank(model, num_slots=4)
    spec_b = LoRASpec(rank=2, alpha=3.0, target_modules=("v_proj", "up_proj"), use_rslora=True)
    ta, tb = make_adapter(model, SMALL, 0), make_adapter(model, spec_b, 1)
    bank.register("a", SMALL, ta)
    bank.register("b", spec_b, tb)
    ha, hb = bank.acquire("a"), bank.acquire("b")
    assert 0 not in (ha.slot, hb.slot) and ha.slot != hb.slot
    ids = torch.randint(4, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with model.lanes(bank.slot_lanes(torch.tensor([hb.slot, 0, ha.slot]))):
            from_slots = model.base(input_ids=ids).logits
        direct = model.lane_batch([(spec_b, tb), None, (SMALL, ta)], torch.arange(3))
        with model.lanes(direct):
            expected = model.base(input_ids=ids).logits
    torch.testing.assert_close(from_slots, expected, rtol=0, atol=1e-5)
    assert not bank.slot_lanes(torch.tensor([0])).scale_L[0]
    assert bank.tensors("b")["model.layers.0.self_attn.v_proj"][1].equal(
        tb["model.layers.0.self_attn.v_proj"][1]
    )


def test_a_decode_batchs_plan_is_kept_while_its_slots_stand(
    model: LoRAModel, make_adapter: MakeAdapter
) -> None:
    """Forwards over the same slot tensor reuse its lane plan; the plan follows the
    tensor being rewritten in place or replaced, and the results are always those of a
    fresh plan."""
    bank = AdapterBank(model, num_slots=4)
    for i, name in enumerate("abc"):
        bank.register(name, SMALL, make_adapter(model, SMALL, 10 + i))
    slots = [bank.acquire(name).slot for name in "abc"]
    ids = torch.randint(4, 128, (4, 1), generator=torch.Generator().manual_seed(1))

    def forward(slot_B: torch.Tensor) -> tuple[object, torch.Tensor]:
        with torch.no_grad(), model.lanes(bank.slot_lanes(slot_B)):
            logits = model.base(input_ids=ids).logits
            current = model._context.current(1, 4)
        assert current is not None
        return current[1], logits

    def fresh(slot_B: torch.Tensor) -> torch.Tensor:
        return forward(slot_B.clone())[1]  # another tensor: a plan of its own

    slot_B = torch.tensor([slots[0], slots[1], slots[2], slots[0]])
    plan, logits = forward(slot_B)
    again, logits_again = forward(slot_B)
    assert again is plan and torch.equal(logits_again, logits)
    slot_B[1:3] = torch.tensor([slots[2], slots[1]])  # rewritten in place: a new plan
    changed, logits_changed = forward(slot_B)
    assert changed is not plan
    torch.testing.assert_close(logits_changed, fresh(slot_B), rtol=0, atol=0)
    assert not torch.equal(logits_changed, logits)


@pytest.mark.parametrize("spill", [False, True])
def test_lru_paging_over_many_tenants(model: LoRAModel, tmp_path: Path, spill: bool) -> None:
    bank = AdapterBank(model, num_slots=16, spill_dir=tmp_path if spill else None)
    n_tenants = 1000 if not spill else 250
    for i in range(n_tenants):
        bank.register(f"t{i}", SMALL, seed=i)
    assert len(bank.tenants()) == n_tenants
    active = [f"t{i}" for i in range(0, n_tenants, n_tenants // 200)][:200]
    expected = {t: bank.tensors(t) for t in active}
    last_slot: dict[str, int] = {}
    recent: list[str] = []  # most recently released last
    rng = torch.Generator().manual_seed(0)
    for step in range(600):
        tenant = active[int(torch.randint(len(active), (1,), generator=rng))]
        before = bank.stats.page_ins
        handle = bank.acquire(tenant)
        resident = tenant in recent[-16:]
        # LRU: a tenant among the 16 most recently released is still resident, in its slot.
        assert (bank.stats.page_ins == before) == resident, step
        if resident:
            assert handle.slot == last_slot[tenant]
        assert _slot_holds(bank, handle, expected[tenant]), (step, tenant)
        bank.release(handle)
        last_slot[tenant] = handle.slot
        if tenant in recent:
            recent.remove(tenant)
        recent.append(tenant)
    assert bank.stats.hits > 0 and bank.stats.evictions > 0
    if spill:
        assert len(list(tmp_path.glob("*/v0.safetensors"))) == n_tenants


def test_capacity_error_when_every_slot_is_pinned(model: LoRAModel) -> None:
    bank = AdapterBank(model, num_slots=2)
    for name in "abc":
        bank.register(name, SMALL, seed=ord(name))
    ha, _ = bank.acquire("a"), bank.acquire("b")
    again = bank.acquire("a")  # a resident adapter needs no new slot
    assert again.slot == ha.slot
    with pytest.raises(CapacityError, match="all 2 adapter slots are pinned"):
        bank.acquire("c")
    bank.release(ha)
    with pytest.raises(CapacityError):
        bank.acquire("c")  # "a" is still pinned by the second handle
    bank.release(again)
    assert bank.acquire("c").slot == ha.slot
    with pytest.raises(ModelError, match="already released"):
        bank.release(again)
    with pytest.raises(TenantNotFound):
        bank.acquire("nobody")


def test_versions_publish_pins_and_drops(
    model: LoRAModel, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    bank = AdapterBank(model, num_slots=4, versions_kept=2, spill_dir=tmp_path)
    bank.register("a", SMALL, seed=0)
    v = [bank.tensors("a", 0)] + [make_adapter(model, SMALL, i) for i in (1, 2, 3)]
    old = bank.acquire("a")  # pins v0
    with pytest.raises(ModelError, match="latest is 0"):
        bank.publish("a", 2, v[2])
    bank.publish("a", 1, v[1])
    bank.publish("a", 2, v[2])
    assert bank.latest_version("a") == 2 and bank.kept_versions("a") == [1, 2]
    with pytest.raises(TenantNotFound, match="kept versions are"):
        bank.acquire("a", 0)
    assert _slot_holds(bank, old, v[0])  # the in-flight handle still samples from v0
    new = bank.acquire("a")
    assert new.version == 2 and new.slot != old.slot and _slot_holds(bank, new, v[2])
    assert _slot_holds(bank, bank.acquire("a", 1), v[1])
    spilled = sorted(p.name for p in tmp_path.glob("*/*.safetensors"))
    assert spilled == ["v0.safetensors", "v1.safetensors", "v2.safetensors"]
    bank.release(old)  # the last pin on a dropped version frees its slot and its file
    assert sorted(p.name for p in tmp_path.glob("*/*.safetensors")) == spilled[1:]
    assert torch.equal(bank.tensors("a", 1)[next(iter(v[1]))][1], next(iter(v[1].values()))[1])

    bank.remove("a")
    with pytest.raises(TenantNotFound):
        bank.latest_version("a")
    bank.release(new)
    assert not list(tmp_path.glob("*/v2.safetensors"))


@pytest.mark.parametrize("spill", [False, True])
def test_an_owned_publication_is_kept_as_given_and_any_other_is_copied(
    model: LoRAModel, make_adapter: MakeAdapter, tmp_path: Path, spill: bool
) -> None:
    """A trainer's adapter (views of one private vector) is kept without a copy, spilled
    as it is; tensors the caller keeps, or that are not float32 CPU ones, are copied."""
    bank = AdapterBank(model, num_slots=4, spill_dir=tmp_path if spill else None)
    bank.register("a", SMALL, seed=0)
    flat = torch.cat(
        [t.reshape(-1) for pair in make_adapter(model, SMALL, 1).values() for t in pair]
    )
    shapes = [(p, A.shape, B.shape) for p, (A, B) in make_adapter(model, SMALL, 1).items()]
    owned, offset = {}, 0
    for path, a_shape, b_shape in shapes:
        A = flat[offset : offset + a_shape.numel()].view(a_shape)
        offset += a_shape.numel()
        owned[path] = (A, flat[offset : offset + b_shape.numel()].view(b_shape))
        offset += b_shape.numel()
    want = {p: (A.clone(), B.clone()) for p, (A, B) in owned.items()}
    bank.publish("a", 1, owned, owned=True)
    assert _slot_holds(bank, bank.acquire("a", 1), want)
    kept = bank._entry("a", 1).tensors
    assert (kept is None) == spill and (spill or kept is owned)
    shared = make_adapter(model, SMALL, 2)
    half = {p: (A.to(torch.float64), B.to(torch.float64)) for p, (A, B) in shared.items()}
    bank.publish("a", 2, half, owned=True)  # not float32: copied and converted
    bank.publish("a", 3, shared)  # the caller's own tensors: copied
    for pair in shared.values():
        pair[0].add_(1.0)  # the caller changes them afterwards
    assert _slot_holds(bank, bank.acquire("a", 2), make_adapter(model, SMALL, 2))
    assert _slot_holds(bank, bank.acquire("a", 3), make_adapter(model, SMALL, 2))


def test_paging_in_clears_the_previous_occupant(
    model: LoRAModel, make_adapter: MakeAdapter
) -> None:
    bank = AdapterBank(model, num_slots=1)
    bank.register("big", FULL, make_adapter(model, FULL, 0))
    bank.register("small", QUERIES, make_adapter(model, QUERIES, 1))
    bank.release(bank.acquire("big"))
    handle = bank.acquire("small")
    assert handle.slot == 1 and bank.stats.evictions == 1
    assert _slot_holds(bank, handle, bank.tensors("small"))
    lanes = bank.slot_lanes(torch.tensor([1]))
    assert set(lanes.A) == QUERY_PATHS
    assert next(iter(lanes.A.values())).shape[1] == 2  # cut to the largest resident rank


def test_slot_lanes_follow_every_change_of_the_resident_adapters(
    model: LoRAModel, make_adapter: MakeAdapter
) -> None:
    """`slot_lanes` reuses its views of the buffers only while the residents stand."""
    bank = AdapterBank(model, num_slots=1)
    bank.register("small", QUERIES, make_adapter(model, QUERIES, 1))
    handle = bank.acquire("small")
    first = bank.slot_lanes(torch.tensor([1]))
    assert set(first.A) == QUERY_PATHS
    again = bank.slot_lanes(torch.tensor([0, 1]))
    assert again.A is first.A and again.lane_B.tolist() == [0, 1]
    bank.register("big", FULL, make_adapter(model, FULL, 0))  # new buffers, nothing resident
    assert set(bank.slot_lanes(torch.tensor([1])).A) == set(first.A)
    bank.release(handle)
    pinned = bank.acquire("big")  # evicts "small": every module, rank 8
    lanes = bank.slot_lanes(torch.tensor([1]))
    assert set(lanes.A) == set(model.module_shapes)
    assert next(iter(lanes.A.values())).shape[1] == 8
    bank.remove("big")
    assert bank.slot_lanes(torch.tensor([0])).A is lanes.A  # pinned: still resident
    bank.release(pinned)  # freed with its last pin
    assert not bank.slot_lanes(torch.tensor([0])).A


def test_register_checks(model: LoRAModel, make_adapter: MakeAdapter) -> None:
    bank = AdapterBank(model, num_slots=2)
    bank.register("a", SMALL)
    with pytest.raises(ModelError, match="already registered"):
        bank.register("a", SMALL)
    with pytest.raises(ModelError, match="max_rank"):
        bank.register("big", LoRASpec(rank=16))
    wrong = make_adapter(model, LoRASpec(rank=2), 0)
    with pytest.raises(ModelError, match="expected A"):
        bank.register("b", SMALL, wrong)
    assert bank.spec("a") == SMALL and "b" not in bank


def test_publish_is_atomic_for_concurrent_readers(model: LoRAModel) -> None:
    """Version v is all (v + 1) tensors; a reader must never see a mix."""
    bank = AdapterBank(model, num_slots=4, versions_kept=2)
    spec = LoRASpec(rank=2, target_modules=("q_proj", "down_proj"))

    def filled(value: float) -> AdapterTensors:
        return {
            p: (torch.full_like(A, value), torch.full_like(B, value))
            for p, (A, B) in model.init_adapter(spec, 0).items()
        }

    bank.register("a", spec, filled(1.0))
    errors: list[str] = []

    def reader() -> None:
        for _ in range(200):
            handle = bank.acquire("a")
            values = {
                float(x)
                for p, A_Lri in bank.slot_lanes(torch.tensor([handle.slot])).A.items()
                for x in A_Lri[handle.slot].unique()
                if x != 0
            }
            if values != {float(handle.version + 1)}:
                errors.append(f"v{handle.version} slot holds {values}")
            bank.release(handle)

    thread = threading.Thread(target=reader)
    thread.start()
    for version in range(1, 100):
        bank.publish("a", version, filled(float(version + 1)))
    thread.join()
    assert not errors, errors[:3]
