"""The kubelet APIs we speak, as our own .proto files and their generated stubs:
the device plugin API v1beta1 (deviceplugin.proto), the PodResources API v1
(podresources.proto), the DRA plugin service v1 (dra.proto) and the plugin
registration API v1 (pluginregistration.proto)."""
