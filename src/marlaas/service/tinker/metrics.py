"""`/metrics` of the Tinker-compatible API: what the device shared (from the port's
`figures()`: training passes, the tenants they held in all and the most one held,
engine iterations and the rows they decoded), and per tenant what its Tinker clients
asked for.

`marlaas_device_pass_tenants` over `marlaas_device_train_passes` is how many tenants
one forward/backward pass held on average: above 1, calls of different tenants ran
together (`marlaas_tinker_forward_backward_calls` counts the Tinker clients' own).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import select

from marlaas.service.models import Tenant
from marlaas.service.tinker.hub import TinkerHub


class TinkerMetrics(Collector):
    def __init__(self, hub: TinkerHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hub = self._hub
        device = hub.device_if_open
        if device is not None:
            f = device.port.figures()
            yield CounterMetricFamily(
                "marlaas_device_busy_seconds",
                "Seconds the device computed (engine iterations and training).",
                value=f.busy_s,
            )
            yield CounterMetricFamily(
                "marlaas_device_train_seconds",
                "Seconds the device spent in training passes and optimizer steps.",
                value=f.busy_train_s,
            )
            yield CounterMetricFamily(
                "marlaas_device_decode_seconds",
                "Seconds the device spent in engine iterations.",
                value=f.busy_decode_s,
            )
            yield CounterMetricFamily(
                "marlaas_device_train_passes",
                "Multi-lane forward/backward passes of the device.",
                value=f.train_passes,
            )
            yield CounterMetricFamily(
                "marlaas_device_pass_tenants",
                "Tenants the device's training passes held, summed over the passes.",
                value=f.pass_tenants,
            )
            yield GaugeMetricFamily(
                "marlaas_device_pass_tenants_max",
                "The most tenants one training pass of the device held.",
                value=f.max_pass_tenants,
            )
            yield CounterMetricFamily(
                "marlaas_device_optim_steps", "Optimizer steps of the device.", value=f.optim_steps
            )
            yield CounterMetricFamily(
                "marlaas_device_decode_steps",
                "Engine iterations of the device.",
                value=f.decode_steps,
            )
            yield GaugeMetricFamily(
                "marlaas_device_decode_rows_mean",
                "Rows decoded per engine iteration, on average (all tenants together).",
                value=f.mean_decode_batch,
            )
        c = hub.counters
        yield CounterMetricFamily(
            "marlaas_tinker_forward_backward_calls",
            "forward_backward calls (with gradient) the Tinker API sent to the device.",
            value=c.forward_backward_calls,
        )
        names = self._names()
        requests = CounterMetricFamily(
            "marlaas_tinker_requests", "Tinker calls by tenant and kind.", labels=["tenant", "kind"]
        )
        for (owner, kind), n in sorted(c.requests.items()):
            requests.add_metric([names.get(owner, owner), kind], n)
        yield requests
        for name, doc, table in (
            ("marlaas_tinker_train_tokens", "Tokens in Tinker training calls.", c.train_tokens),
            ("marlaas_tinker_sampled_tokens", "Tokens Tinker clients sampled.", c.sampled_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for owner, n in sorted(table.items()):
                family.add_metric([names.get(owner, owner)], n)
            yield family
        runs = GaugeMetricFamily(
            "marlaas_tinker_runs_active", "Tinker training runs on the device.", labels=["tenant"]
        )
        live: dict[str, int] = {}
        for run in list(hub.runs.values()):
            live[run.owner] = live.get(run.owner, 0) + 1
        for owner, n in sorted(live.items()):
            runs.add_metric([names.get(owner, owner)], n)
        yield runs

    def _names(self) -> dict[str, str]:
        with self._hub.store.db.transaction() as session:
            return dict(session.execute(select(Tenant.id, Tenant.name)).tuples().all())
