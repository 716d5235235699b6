"""The device plugin API's fixed names, as the kubelet has them.

The API version a plugin registers with, the directory plugins serve their sockets in and
the kubelet's own registration socket there. The kubelet hard-codes the socket's place
whatever its ``--root-dir`` says (``KubeletSocket`` in
``pkg/kubelet/cm/devicemanager/manager.go`` and ``DevicePluginPath`` in
``staging/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go``), so the plugin and
the tests' kubelet stand-in both take them from here.
"""

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"


def socket_name_for(resource_name: str) -> str:
    """Our plugins' default socket file name, which the agent's offer gate also dials:
    ``nvidia.com/GA102GL_A10`` -> ``nvidia.com-GA102GL_A10.sock``."""
    return resource_name.replace("/", "-") + ".sock"
