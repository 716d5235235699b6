"""The kubelet APIs we speak, as our own .proto files and their generated stubs:
the device plugin API v1beta1 (deviceplugin.proto) and the PodResources API v1
(podresources.proto)."""
