"""The device plugins on a real kubelet: what the Node advertises, and a relabel.

Facts from the kubelet (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager): a plugin
registers on /var/lib/kubelet/device-plugins/kubelet.sock whatever --root-dir says
(manager.go: pluginapi.KubeletSocket); its resource enters the Node's capacity and
allocatable with the healthy device count; a plugin that stops leaves its resource in
capacity with 0 allocatable until the endpoint's grace period ends (endpoint.go:
endpointStopGracePeriod, 5 minutes).
"""

from __future__ import annotations

from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, NVSWITCH_RESOURCE, WORKLOAD, metric, restart_count

AGENT = "app.kubernetes.io/component=sandbox-agent"
CONTAINER_PLUGIN = "app.kubernetes.io/component=device-plugin"


def test_both_plugins_registered_and_the_node_lists_model_named_resources(node):
    status = node.wait_resource(GPU_RESOURCE, 8)
    node.wait_resource(NVSWITCH_RESOURCE, 4)
    assert status["capacity"][GPU_RESOURCE] == "8"
    kubelet = node.cluster.log("kubelet")
    for resource in (GPU_RESOURCE, NVSWITCH_RESOURCE):
        assert f'registration request from device plugin with resource" resourceName="{resource}"' \
            in kubelet, f"the kubelet logged no registration of {resource}"
    agent = node.component_pod("sandbox-agent")
    metrics = node.scrape(agent, 9411)
    for resource in (GPU_RESOURCE, NVSWITCH_RESOURCE):
        assert metric(metrics, "sandbox_device_plugin_kubelet_registrations_total", resource=resource) >= 1


def test_relabel_to_container_and_back_without_restarting_the_agent(node):
    before = node.component_pod("sandbox-agent")
    try:
        node.label(WORKLOAD, "container")
        # The agent gives the GPUs back to nvidia; the sandbox plugin stands down and the
        # container plugin's DaemonSet starts on the node, its NVML stand-in listing them.
        wait_for(lambda: node.resources().get(GPU_RESOURCE) == "0",
                 f"{GPU_RESOURCE} allocatable 0 on a container node", 60, every=0.5)
        node.wait_ready(CONTAINER_PLUGIN)
        node.wait_resource("nvidia.com/gpu", 8, timeout=90)
        assert node.resources().get(NVSWITCH_RESOURCE) == "0"
    finally:
        node.label(WORKLOAD, "vm-passthrough")
    node.wait_resource(GPU_RESOURCE, 8, timeout=90)
    # The container plugin's pod stays (the chart runs it on vm-passthrough nodes too, for a
    # split node's container share) and stands down: this node has no container side.
    wait_for(lambda: node.resources().get("nvidia.com/gpu") == "0",
             "nvidia.com/gpu allocatable 0 again", 90, every=0.5)
    after = node.component_pod("sandbox-agent")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert restart_count(after) == restart_count(before) == 0
