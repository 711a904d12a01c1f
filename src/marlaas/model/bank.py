"""The adapter bank: every tenant's adapter versions, and the compute slots they run in.

Many more tenants are registered than fit on the device. Each tenant's adapters live in
host memory (or, with `spill_dir`, in safetensors files loaded on demand); a fixed set
of compute slots holds the adapters in use, as stacked buffers on the base's device: per
module some registered adapter targets, one `[S, r_max, in]` A buffer and one
`[S, out, r_max]` B buffer (allocated when the first tenant targeting the module
registers, then kept), plus `scale_S`. `slot_lanes()` hands these buffers to the multi-LoRA layers
as a `LaneBatch` (lane = slot), so one forward serves rows of any resident adapters.

Invariants:
- Slot 0 is the plain base (zeros, scale 0) and is never given to a tenant.
- A slot is written only while no handle pins it. A handle's slot keeps exactly the
  (tenant, version) it was acquired for until it is released, so publishing a new
  version never changes what an in-flight sequence samples from.
- Versions of a tenant are 0, 1, 2, ... with no gaps; the newest `versions_kept` stay
  acquirable, older ones are dropped, except that a version still pinned by a handle
  keeps its slot (and host copy) until the last handle is released.
- Unpinned resident slots are reused least-recently-released first; paging in copies
  the host tensors into the slot and zeroes the rest of it (padding rank, untargeted
  modules), so nothing of the previous occupant can leak.
- Every public method holds one lock, so concurrent callers see a version either wholly
  published or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.errors import CapacityError, ModelError, TenantNotFound
from marlaas.fileio import atomic_write
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import AdapterTensors, LoRAModel


@dataclass(frozen=True)
class AdapterHandle:
    """A pin on one (tenant, version) in compute slot `slot`; give it back with `release`."""

    tenant: str
    version: int
    slot: int
    spec: LoRASpec
    handle_id: int
    #: Names the adapter's weights: unique to this (tenant, version) registration in
    #: this bank (a tenant removed and registered again gets new ids), so a cache keyed
    #: by it never serves another adapter's results.
    adapter_id: int = 0


@dataclass(eq=False)
class _Version:
    tenant: str
    version: int
    spec: LoRASpec
    tensors: AdapterTensors | None  # host copy, float32 on the CPU; None when spilled
    path: Path | None  # spill file
    modules: frozenset[str] = frozenset()  # the module paths the spec targets
    adapter_id: int = 0
    pins: int = 0
    slot: int | None = None
    kept: bool = True


@dataclass(eq=False)
class _Tenant:
    name: str
    spec: LoRASpec
    spill_dir: Path | None
    modules: frozenset[str]
    versions: dict[int, _Version] = field(default_factory=dict)
    latest: int = 0


@dataclass
class BankStats:
    page_ins: int = 0
    hits: int = 0
    evictions: int = 0


class AdapterBank:
    """Tenants' adapter versions in host memory, paged into `num_slots` compute slots.

    `num_slots` counts the slots tenants can use; the buffers have `num_slots + 1`
    lanes because lane 0 is the plain base. `dtype` is the slot buffers' dtype, float32
    by default whatever the base's: sampling then uses exactly the trainer's float32
    adapter weights (the multi-LoRA layers compute the update in the adapter's dtype).
    """

    def __init__(
        self,
        model: LoRAModel,
        num_slots: int,
        versions_kept: int = 2,
        spill_dir: Path | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_slots < 1:
            raise ModelError(f"num_slots must be >= 1, got {num_slots}")
        if versions_kept < 1:
            raise ModelError(f"versions_kept must be >= 1, got {versions_kept}")
        self.model = model
        self.num_slots = num_slots
        self.versions_kept = versions_kept
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.stats = BankStats()
        self._lock = threading.RLock()
        self._tenants: dict[str, _Tenant] = {}
        self._handles: dict[int, _Version] = {}
        self._next_handle = 0
        self._next_spill = 0
        self._next_adapter_id = 0

        S = num_slots + 1
        self._dtype = dtype or torch.float32
        self._A: dict[str, Tensor] = {}  # per module path, allocated on first use
        self._B: dict[str, Tensor] = {}
        self._scale_S = torch.zeros(S, device=model.device, dtype=torch.float32)
        self._slots: list[_Version | None] = [None] * S
        self._free: list[int] = list(range(S - 1, 0, -1))  # pop() hands out 1, 2, ...
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned resident, oldest first
        #: `slot_lanes`' views of the buffers (A, B), reused while the resident adapters
        #: and the buffers stand (one lane batch a forward); None after any change.
        self._views: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        #: Each slot's (A, B) views per module path, made once per slot while the buffers
        #: stand: a page-in then starts no tensor op per module but its copies.
        self._slot_bufs: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}

    @property
    def num_lanes(self) -> int:
        return self.num_slots + 1

    @property
    def dtype(self) -> torch.dtype:
        """The slot buffers' dtype."""
        return self._dtype

    # -- tenants and versions ------------------------------------------------------------

    def register(
        self,
        tenant: str,
        spec: LoRASpec,
        tensors: AdapterTensors | None = None,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        """Add a tenant at `version` (a restored tenant's; its only kept version): `tensors`,
        or a fresh PEFT-style init from `seed`."""
        with self._lock:
            if version < 0:
                raise ModelError(f"tenant {tenant!r}: version must be >= 0, got {version}")
            if tenant in self._tenants:
                raise ModelError(f"tenant {tenant!r} is already registered; remove it first")
            modules = frozenset(self.model.module_paths(spec))
            fresh = tensors is None
            if tensors is None:
                tensors = self.model.init_adapter(spec, seed)
            else:
                self.model.check_tensors(spec, tensors)
            spill = None
            if self.spill_dir is not None:
                spill = self.spill_dir / f"{_safe_name(tenant)}-{self._next_spill}"
                self._next_spill += 1
                spill.mkdir(parents=True)
            record = _Tenant(
                name=tenant, spec=spec, spill_dir=spill, modules=modules, latest=version
            )
            record.versions[version] = self._store(record, version, tensors, owned=fresh)
            self._allocate(modules)
            self._tenants[tenant] = record

    def remove(self, tenant: str) -> None:
        """Forget a tenant. Slots pinned by in-flight handles are freed on release."""
        with self._lock:
            record = self._get(tenant)
            del self._tenants[tenant]
            for entry in record.versions.values():
                entry.kept = False
                if entry.pins == 0:
                    self._discard(entry)
            record.versions.clear()

    def publish(
        self, tenant: str, version: int, tensors: AdapterTensors, *, owned: bool = False
    ) -> None:
        """Add `version` (must be latest + 1) and drop versions older than the kept window.
        `owned`: `tensors` are a float32 CPU copy that nobody else holds (a trainer's
        `adapter`), kept as they are; else the bank keeps a copy of its own."""
        # Outside the lock: readers never wait on the copy.
        host = tensors if owned and _is_host(tensors) else _host_copy(tensors)
        with self._lock:
            record = self._get(tenant)
            if version != record.latest + 1:
                raise ModelError(
                    f"tenant {tenant!r}: published version {version}, but the latest is "
                    f"{record.latest}; versions go up by exactly one"
                )
            self.model.check_tensors(record.spec, host)
            record.versions[version] = self._store(record, version, host, owned=True)
            record.latest = version
            for old in [v for v in record.versions if v <= version - self.versions_kept]:
                entry = record.versions.pop(old)
                entry.kept = False
                if entry.pins == 0:
                    self._discard(entry)

    def latest_version(self, tenant: str) -> int:
        with self._lock:
            return self._get(tenant).latest

    def kept_versions(self, tenant: str) -> list[int]:
        with self._lock:
            return sorted(self._get(tenant).versions)

    def spec(self, tenant: str) -> LoRASpec:
        with self._lock:
            return self._get(tenant).spec

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._tenants)

    def __contains__(self, tenant: object) -> bool:
        with self._lock:
            return tenant in self._tenants

    def tensors(self, tenant: str, version: int | None = None) -> AdapterTensors:
        """A copy of a kept version's tensors (PEFT layout, float32, CPU)."""
        with self._lock:
            entry = self._entry(tenant, version)
            return {p: (A.clone(), B.clone()) for p, (A, B) in self._host(entry).items()}

    # -- compute slots -------------------------------------------------------------------

    def acquire(self, tenant: str, version: int | None = None) -> AdapterHandle:
        """Pin (tenant, version) into a compute slot, paging it in if it is not resident.

        `version=None` is the latest. Raises `TenantNotFound` for an unknown tenant or a
        version no longer kept, and `CapacityError` when every slot is pinned.
        """
        with self._lock:
            entry = self._entry(tenant, version)
            if entry.slot is not None:
                self.stats.hits += 1
                if entry.pins == 0:
                    self._lru.pop(entry.slot)
            else:
                slot = self._take_slot()
                self._page_in(slot, entry)
            assert entry.slot is not None
            entry.pins += 1
            self._next_handle += 1
            self._handles[self._next_handle] = entry
            return AdapterHandle(
                tenant=entry.tenant,
                version=entry.version,
                slot=entry.slot,
                spec=entry.spec,
                handle_id=self._next_handle,
                adapter_id=entry.adapter_id,
            )

    def release(self, handle: AdapterHandle) -> None:
        """Unpin; the slot stays resident (reusable, least recently released first)."""
        with self._lock:
            entry = self._handles.pop(handle.handle_id, None)
            if entry is None:
                raise ModelError(
                    f"handle {handle.handle_id} ({handle.tenant!r} v{handle.version}) was "
                    "already released or does not come from this bank"
                )
            entry.pins -= 1
            if entry.pins > 0:
                return
            if entry.kept:
                assert entry.slot is not None
                self._lru[entry.slot] = None
            else:
                self._discard(entry)

    def slot_lanes(self, slot_B: Tensor) -> LaneBatch:
        """A lane batch over all slot buffers (lane = slot) with row b using `slot_B[b]`.

        The rank axis is cut to the largest rank resident, and modules no resident adapter
        targets are left out (they compute the plain base), so idle capacity costs nothing.
        """
        with self._lock:
            if self._views is None:
                resident = [e for e in self._slots if e is not None]
                r = max([e.spec.rank for e in resident] + [1])
                targeted = frozenset().union(*(e.modules for e in resident))
                paths = [p for p in self._A if p in targeted]
                self._views = (
                    {p: self._A[p][:, :r] for p in paths},
                    {p: self._B[p][:, :, :r] for p in paths},
                )
            A, B = self._views
            return LaneBatch(lane_B=slot_B, A=A, B=B, scale_L=self._scale_S, prescaled=True)

    # -- internals -----------------------------------------------------------------------

    def _allocate(self, modules: frozenset[str]) -> None:
        """Zeroed slot buffers for the modules that have none yet (every slot's lane of a
        new buffer is zero: no resident adapter targets that module)."""
        S, r, dev = self.num_lanes, self.model.max_rank, self.model.device
        shapes = self.model.module_shapes
        self._views = None
        for path in shapes:  # module order
            if path in modules and path not in self._A:
                self._slot_bufs.clear()
                fan_in, fan_out = shapes[path]
                self._A[path] = torch.zeros(S, r, fan_in, device=dev, dtype=self._dtype)
                # Rank-major (`out` contiguous) under PEFT's `[S, out, r]` view: how the
                # native LoRA kernel reads B in place (`marlaas.model.kernels.lora_rows`).
                self._B[path] = torch.zeros(S, r, fan_out, device=dev, dtype=self._dtype).transpose(
                    1, 2
                )

    def _get(self, tenant: str) -> _Tenant:
        record = self._tenants.get(tenant)
        if record is None:
            raise TenantNotFound(f"no tenant {tenant!r} is registered in the adapter bank")
        return record

    def _entry(self, tenant: str, version: int | None) -> _Version:
        record = self._get(tenant)
        v = record.latest if version is None else version
        entry = record.versions.get(v)
        if entry is None:
            raise TenantNotFound(
                f"tenant {tenant!r} has no adapter version {v}; kept versions are "
                f"{sorted(record.versions)}"
            )
        return entry

    def _store(
        self, record: _Tenant, version: int, tensors: AdapterTensors, owned: bool = False
    ) -> _Version:
        """Keep a version: a private float32 CPU copy (`owned`: `tensors` already is one)."""
        host = tensors if owned else _host_copy(tensors)
        self._next_adapter_id += 1
        adapter_id = self._next_adapter_id
        if record.spill_dir is None:
            return _Version(
                record.name,
                version,
                record.spec,
                tensors=host,
                path=None,
                modules=record.modules,
                adapter_id=adapter_id,
            )
        path = record.spill_dir / f"v{version}.safetensors"
        flat = {f"{p}.lora_A": A for p, (A, _) in host.items()}
        flat.update({f"{p}.lora_B": B for p, (_, B) in host.items()})
        atomic_write(path, lambda tmp: save_file(flat, str(tmp)))
        return _Version(
            record.name,
            version,
            record.spec,
            tensors=None,
            path=path,
            modules=record.modules,
            adapter_id=adapter_id,
        )

    def _host(self, entry: _Version) -> AdapterTensors:
        if entry.tensors is not None:
            return entry.tensors
        if entry.path is None:
            raise ModelError(f"adapter {entry.tenant!r} v{entry.version} has been dropped")
        flat = load_file(str(entry.path))
        paths = [k[: -len(".lora_A")] for k in flat if k.endswith(".lora_A")]
        return {p: (flat[f"{p}.lora_A"], flat[f"{p}.lora_B"]) for p in paths}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._lru:
            raise CapacityError(
                f"all {self.num_slots} adapter slots are pinned by in-flight requests; wait "
                "for requests to finish (release their handles) or create the bank with "
                "more num_slots"
            )
        slot, _ = self._lru.popitem(last=False)
        evicted = self._slots[slot]
        assert evicted is not None
        evicted.slot = None
        self._slots[slot] = None
        self._views = None
        self.stats.evictions += 1
        return slot

    @torch.no_grad()
    def _page_in(self, slot: int, entry: _Version) -> None:
        tensors = self._host(entry)
        r = entry.spec.rank
        cleared: list[Tensor] = []
        slot_A: list[Tensor] = []
        host_A: list[Tensor] = []
        slot_B: list[Tensor] = []
        host_B: list[Tensor] = []
        bufs = self._slot_bufs.get(slot)
        if bufs is None:
            bufs = {path: (self._A[path][slot], self._B[path][slot]) for path in self._A}
            self._slot_bufs[slot] = bufs
        for path, (A_buf, B_buf) in bufs.items():
            pair = tensors.get(path)
            if pair is None or r == 0:
                cleared += [A_buf, B_buf]
                continue
            # Only the ranks past the adapter's need clearing: a page-in per new version.
            if r < self.model.max_rank:
                cleared += [A_buf[r:], B_buf[:, r:]]
                A_buf, B_buf = A_buf[:r], B_buf[:, :r]
            slot_A.append(A_buf)
            host_A.append(pair[0])
            slot_B.append(B_buf)
            host_B.append(pair[1])
        # A few multi-tensor ops rather than three per module: the device thread pays for
        # every op it starts while the event loop holds the interpreter (a page-in took
        # 4-6 ms in the pipeline at 84 ops).
        if cleared:
            torch._foreach_zero_(cleared)
        if slot_A:
            torch._foreach_copy_(slot_A + slot_B, host_A + host_B)
            # B carries the scale: the layers skip a multiplication per module.
            torch._foreach_mul_(slot_B, entry.spec.scaling)
        self._scale_S[slot] = entry.spec.scaling
        self._slots[slot] = entry
        self._views = None
        entry.slot = slot
        self.stats.page_ins += 1

    def _discard(self, entry: _Version) -> None:
        """Drop an unpinned version that is no longer kept: free its slot and storage."""
        if entry.slot is not None:
            self._lru.pop(entry.slot, None)
            self._slots[entry.slot] = None
            self._views = None
            self._scale_S[entry.slot] = 0.0
            self._free.append(entry.slot)
            entry.slot = None
        entry.tensors = None
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the tenant's directory, once empty
                entry.path.parent.rmdir()
            entry.path = None


def _safe_name(tenant: str) -> str:
    """A file-system-safe, collision-free directory name for a tenant."""
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tenant)[:40]}-{digest}"


def _is_host(tensors: AdapterTensors) -> bool:
    """Whether every tensor is float32 on the CPU, outside any autograd graph."""
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad
        for pair in tensors.values()
        for t in pair
    )


def _host_copy(tensors: AdapterTensors) -> AdapterTensors:
    """A private float32 CPU copy, detached from any autograd graph."""
    return {
        p: (
            A.detach().to(device="cpu", dtype=torch.float32, copy=True),
            B.detach().to(device="cpu", dtype=torch.float32, copy=True),
        )
        for p, (A, B) in tensors.items()
    }
