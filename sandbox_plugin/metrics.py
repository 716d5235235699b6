"""The device plugin's Prometheus metrics, in a registry of its own (one per
``PluginManager``), served by ``gpunode.services.metrics_server`` with
``--metrics-address``.

The plugin counts in plain Python objects, and ``prometheus_client`` is loaded
only when the registry is first asked for (that is, when the metrics are
served): loading it takes tens of milliseconds and several MiB that a plugin
run without ``--metrics-address`` has no use for, and the kubelet waits for
the plugin's start-up. Counting this way also keeps Allocate's share small
(one lock and a bucket search, no label lookup per call).
"""

from __future__ import annotations

import bisect
import threading

from gpunode.policy import health

ALLOCATE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _CounterChild:
    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount


class _HistogramChild:
    __slots__ = ("_lock", "buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self.counts[index] += 1
            self.sum += value


class _Family:
    """A labelled metric: ``labels(*values)`` gives the child to count in."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], make) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._make = make
        self._lock = threading.Lock()
        self.children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        child = self.children.get(values)
        if child is None:
            with self._lock:
                child = self.children.setdefault(values, self._make())
        return child

    def snapshot(self) -> list[tuple[tuple[str, ...], object]]:
        with self._lock:
            return list(self.children.items())


class PluginMetrics:
    def __init__(self) -> None:
        self.allocate_seconds = _Family(
            "sandbox_device_plugin_allocate_duration_seconds", "How long an Allocate call took.",
            ("resource",), lambda: _HistogramChild(ALLOCATE_BUCKETS))
        self.allocate_errors = _Family(
            "sandbox_device_plugin_allocate_errors", "Allocate calls refused, by gRPC status code.",
            ("resource", "code"), _CounterChild)
        self.preferred_seconds = _Family(
            "sandbox_device_plugin_preferred_allocation_duration_seconds",
            "How long a GetPreferredAllocation call took.", ("resource",),
            lambda: _HistogramChild(ALLOCATE_BUCKETS))
        self.preferred_allocations = _Family(
            "sandbox_device_plugin_preferred_allocations",
            "GetPreferredAllocation calls answered (the kubelet asks before Allocate when a "
            "request leaves it a choice).", ("resource",), _CounterChild)
        self.registrations = _Family(
            "sandbox_device_plugin_kubelet_registrations", "Successful registrations with the kubelet.",
            ("resource",), _CounterChild)
        self.registration_failures = _Family(
            "sandbox_device_plugin_kubelet_registration_failures", "Failed registration attempts.",
            ("resource",), _CounterChild)
        self.health_transitions = _Family(
            "sandbox_device_plugin_device_health_transitions",
            "A passthrough device turning Unhealthy (by reason: "
            f"{', '.join(health.codes(health.LASTING, health.TRIP, health.HAND_BACK))}) or Healthy again, "
            "from the host kernel's facts: AER, link, config space, reset method, hand-back.",
            ("device", "health", "reason"), _CounterChild)
        # The NVSwitch board's model (sandbox_plugin.fabricgate): "none" while its GPUs are
        # withheld; None on a node without NVSwitches (no series).
        self.nvlink_model: str | None = None
        self._registry = None
        self._lock = threading.Lock()

    def health_changed(self, bdf: str, code: str, message: str) -> None:
        """``devhealth.DeviceHealth``'s transition: ``code`` (one of ``gpunode.policy.health``'s
        reasons), "" when Healthy again."""
        self.health_transitions.labels(bdf, "Unhealthy" if code else "Healthy", code).inc()

    @property
    def registry(self):
        """A ``prometheus_client.CollectorRegistry`` reading these counts (made on first use)."""
        with self._lock:
            if self._registry is None:
                from prometheus_client import CollectorRegistry

                self._registry = CollectorRegistry()
                self._registry.register(_Collector(self))
            return self._registry


class _Collector:
    def __init__(self, metrics: PluginMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # unchecked collector: the names are ours alone in this registry

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        m = self.metrics
        for family in (m.allocate_seconds, m.preferred_seconds):
            histogram = HistogramMetricFamily(family.name, family.documentation, labels=family.labelnames)
            for labels, child in family.snapshot():
                with child._lock:
                    counts, total = list(child.counts), child.sum
                cumulative, buckets = 0, []
                for bound, count in zip((*child.buckets, float("inf")), counts, strict=True):
                    cumulative += count
                    buckets.append((_bound(bound), cumulative))
                histogram.add_metric(list(labels), buckets, total)
            yield histogram
        for family in (m.allocate_errors, m.preferred_allocations, m.registrations,
                       m.registration_failures, m.health_transitions):
            counter = CounterMetricFamily(family.name, family.documentation, labels=family.labelnames)
            for labels, child in family.snapshot():
                counter.add_metric(list(labels), child.value)
            yield counter
        if m.nvlink_model is not None:
            gauge = GaugeMetricFamily(
                "sandbox_device_plugin_nvlink_fabric_model",
                "1 for the NVLink fabric model the NVSwitch board follows (none: neither of NVIDIA's "
                "models holds, and its GPUs are not advertised).", labels=("model",))
            gauge.add_metric([m.nvlink_model], 1)
            yield gauge


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))

