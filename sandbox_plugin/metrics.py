"""The device plugin's Prometheus metrics, in a registry of its own (one per
``PluginManager``), served by ``katamgr.host.metrics_server`` with
``--metrics-address``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class PluginMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.allocate_seconds = Histogram(
            "sandbox_device_plugin_allocate_duration_seconds", "How long an Allocate call took.",
            ["resource"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.allocate_errors = Counter(
            "sandbox_device_plugin_allocate_errors", "Allocate calls refused, by gRPC status code.",
            ["resource", "code"], registry=r)
        self.registrations = Counter(
            "sandbox_device_plugin_kubelet_registrations", "Successful registrations with the kubelet.",
            ["resource"], registry=r)
        self.registration_failures = Counter(
            "sandbox_device_plugin_kubelet_registration_failures", "Failed registration attempts.",
            ["resource"], registry=r)
