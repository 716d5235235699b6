{{/*
The node's files the pods reach: host paths below hostPaths.rootFS (ksm.hostPath) and their
place in a container (ksm.inHost: below --host-root /host), the katamgr container's mounts
and volumes (the agent's and the uninstall revert's alike), the view of the node's Kata the
plugins share, the kubelet's sockets and the NVLink fabric's dirs.
*/}}

{{/* A host path below hostPaths.rootFS, as the kubelet sees it. Call with (list $ "/sys"). */}}
{{- define "ksm.hostPath" -}}
{{- $root := (index . 0).Values.hostPaths.rootFS | trimSuffix "/" -}}
{{- printf "%s%s" $root (index . 1) -}}
{{- end -}}

{{/*
The kubelet's root dir on the node (its --root-dir): hostPaths.kubeletRootDir, as the GPU
Operator names it (k0s: /var/lib/k0s/kubelet; microk8s:
/var/snap/microk8s/common/var/lib/kubelet); empty, /var/lib/kubelet. Its pod-resources,
plugins and plugins_registry dirs are below it (kubelet_getters.go), and the node programs
are told where (--kubelet-dir). The device plugins' dir is not: the kubelet serves its
registration socket at /var/lib/kubelet/device-plugins/kubelet.sock whatever its root dir
(devicemanager.NewManagerImpl takes pluginapi.KubeletSocket), so that one stays.
*/}}
{{- define "ksm.kubeletDir" -}}
{{- .Values.hostPaths.kubeletRootDir | default "/var/lib/kubelet" | trimSuffix "/" -}}
{{- end -}}

{{/* Where a host path is reachable inside our containers (--host-root /host). */}}
{{- define "ksm.inHost" -}}
{{- printf "/host%s" . -}}
{{- end -}}

{{/*
The host the agent container (katamgr run) works on, and the same for katamgr revert in the
uninstall hook, so a revert reaches everything the agent changed: the locals both need
(JSON: vfio cdi kata signal hostProc containerdSocketDir artifactsDir layoutDirs).
*/}}
{{- define "ksm.agentHost" -}}
{{- $v := .Values -}}
{{- $kata := include "ksm.kata" . -}}
{{- $signal := and $kata (eq $v.containerd.restartMode "signal") -}}
{{- $layoutDirs := list -}}
{{- if $kata -}}
{{- $layoutDirs = include "ksm.ociLayoutDirs" . | splitList "\n" | compact -}}
{{- end -}}
{{- toJson (dict
      "vfio" $v.vfioManager.enabled
      "cdi" $v.cdi.enabled
      "kata" (not (empty $kata))
      "signal" (not (empty $signal))
      "hostProc" (and (include "ksm.agent" .) (or $v.vfioManager.enabled $signal))
      "containerdSocketDir" (dir $v.containerd.socket)
      "artifactsDir" ($v.kataManager.config.artifactsDir | trimSuffix "/")
      "layoutDirs" $layoutDirs) -}}
{{- end -}}

{{/* The volumeMounts of the katamgr container (agent and uninstall revert). */}}
{{- define "ksm.agentMounts" -}}
{{- $h := include "ksm.agentHost" . | fromJson -}}
- name: config
  mountPath: /etc/kata-sandbox-manager
  readOnly: true
- name: validations
  mountPath: {{ include "ksm.inHost" "/run/nvidia/validations" }}
- name: state
  mountPath: {{ include "ksm.inHost" "/var/lib/kata-sandbox-manager" }}
# Which side each GPU of a split node is on (the plugins list from it); a revert removes it.
- name: split-sides
  mountPath: {{ include "ksm.inHost" "/run/kata-sandbox-manager" }}
- name: sysfs
  mountPath: {{ include "ksm.inHost" "/sys" }}
  readOnly: {{ not $h.vfio }}
{{- if $h.hostProc }}
- name: proc
  mountPath: {{ include "ksm.inHost" "/proc" }}
  readOnly: true
{{- end }}
{{- if or $h.vfio $h.cdi }}
- name: dev-vfio
  mountPath: {{ include "ksm.inHost" "/dev/vfio" }}
  readOnly: true
{{- end }}
{{- if $h.vfio }}
- name: lib-modules
  mountPath: {{ include "ksm.inHost" "/lib/modules" }}
  readOnly: true
# A workload switch keeps the GPUs the kubelet gave pods (its PodResources API).
- name: pod-resources
  mountPath: {{ include "ksm.inHost" (printf "%s/pod-resources" (include "ksm.kubeletDir" .)) }}
  readOnly: true
{{- end }}
# The node's Kata (gpunode.policy.katadetect): containerd's config and kata-deploy's install,
# where katamgr writes its GPU drop-in beside kata-deploy's config; read-only without Kata.
{{ include "ksm.nodeKataMounts" (list . $h.kata) }}
{{- if $h.kata }}
- name: containerd-socket
  mountPath: {{ include "ksm.inHost" $h.containerdSocketDir }}
- name: artifacts
  mountPath: {{ include "ksm.inHost" $h.artifactsDir }}
{{- range $i, $dir := $h.layoutDirs }}
- name: oci-layout-{{ $i }}
  mountPath: {{ include "ksm.inHost" $dir }}
  readOnly: true
{{- end }}
{{- end }}
{{- if $h.cdi }}
- name: cdi
  mountPath: {{ include "ksm.inHost" "/var/run/cdi" }}
{{- end }}
{{- /* The plan's NVLink fabric section asks FM (read-only; the state dir is mounted above). */}}
{{- range $i, $dir := include "ksm.fabricDirs" . | fromJsonArray }}
{{- if ne $dir "/var/lib/kata-sandbox-manager" }}
- name: fabric-{{ $i }}
  mountPath: {{ include "ksm.inHost" $dir }}
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* The volumes of ksm.agentMounts. Call with (list $ CONFIGMAP-NAME). */}}
{{- define "ksm.agentVolumes" -}}
{{- $root := index . 0 -}}
{{- $h := include "ksm.agentHost" $root | fromJson -}}
- name: config
  configMap:
    name: {{ index . 1 }}
- name: sysfs
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/sys") }}
    type: Directory
{{- if or $h.vfio $h.cdi }}
# Created by the kernel once vfio is loaded; created here first so the pod can start.
- name: dev-vfio
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/dev/vfio") }}
    type: DirectoryOrCreate
{{- end }}
- name: validations
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/run/nvidia/validations") }}
    type: DirectoryOrCreate
- name: state
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/var/lib/kata-sandbox-manager") }}
    type: DirectoryOrCreate
- name: split-sides
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/run/kata-sandbox-manager") }}
    type: DirectoryOrCreate
{{- if $h.hostProc }}
- name: proc
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/proc") }}
    type: Directory
{{- end }}
{{- if $h.vfio }}
- name: lib-modules
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/lib/modules") }}
    type: Directory
{{ include "ksm.podResourcesVolume" $root }}
{{- end }}
{{ include "ksm.nodeKataVolumes" $root }}
{{- if $h.kata }}
- name: containerd-socket
  hostPath:
    path: {{ include "ksm.hostPath" (list $root $h.containerdSocketDir) }}
    type: Directory
- name: artifacts
  hostPath:
    path: {{ include "ksm.hostPath" (list $root $h.artifactsDir) }}
    type: DirectoryOrCreate
{{- /* OCI image layouts copied onto the node for air-gapped installs. Created
       empty where missing, so a node lacking one still binds its GPUs and katamgr
       names the runtime class whose artifacts it cannot find. */}}
{{- range $i, $dir := $h.layoutDirs }}
- name: oci-layout-{{ $i }}
  hostPath:
    path: {{ include "ksm.hostPath" (list $root $dir) }}
    type: DirectoryOrCreate
{{- end }}
{{- end }}
{{- if $h.cdi }}
- name: cdi
  hostPath:
    path: {{ include "ksm.hostPath" (list $root "/var/run/cdi") }}
    type: DirectoryOrCreate
{{- end }}
{{- end -}}

{{/* Where the node's Kata is found (gpunode.policy.katadetect): containerd's config dir and
kata-deploy's install dir (/opt/kata: its shims, VERSION and configs; created empty on a node
without it, as the container runtime would). */}}
{{- define "ksm.nodeKataVolumes" -}}
- name: containerd-config
  hostPath:
    path: {{ include "ksm.hostPath" (list . (dir .Values.containerd.configPath)) }}
    type: Directory
- name: kata-deploy
  hostPath:
    path: {{ include "ksm.hostPath" (list . "/opt/kata") }}
    type: DirectoryOrCreate
{{- end -}}

{{/* The mounts of ksm.nodeKataVolumes. Call with (list $ WRITABLE): writable for katamgr with
Kata (its GPU drop-in goes beside kata-deploy's config); read-only for the device plugin and
the DRA driver, which read the release from the config the agent reads (--containerd-config),
so that all three decide by one release. */}}
{{- define "ksm.nodeKataMounts" -}}
{{- $readOnly := not (index . 1) -}}
- name: containerd-config
  mountPath: {{ include "ksm.inHost" (dir (index . 0).Values.containerd.configPath) }}
  {{- if $readOnly }}
  readOnly: true
  {{- end }}
- name: kata-deploy
  mountPath: {{ include "ksm.inHost" "/opt/kata" }}
  {{- if $readOnly }}
  readOnly: true
  {{- end }}
{{- end -}}

{{/*
Kubelet sockets every device-plugin container needs: its own registration dir (fixed by the
kubelet, ksm.kubeletDir), and pod-resources (read-only: connecting to a unix socket works on a
read-only mount).
*/}}
{{- define "ksm.kubeletMounts" -}}
- name: device-plugins
  mountPath: {{ include "ksm.inHost" "/var/lib/kubelet/device-plugins" }}
- name: pod-resources
  mountPath: {{ include "ksm.inHost" (printf "%s/pod-resources" (include "ksm.kubeletDir" .)) }}
  readOnly: true
{{- end -}}

{{- define "ksm.kubeletVolumes" -}}
{{ include "ksm.devicePluginsVolume" . }}
{{ include "ksm.podResourcesVolume" . }}
{{- end -}}

{{- define "ksm.devicePluginsVolume" -}}
- name: device-plugins
  hostPath:
    path: {{ include "ksm.hostPath" (list . "/var/lib/kubelet/device-plugins") }}
    type: Directory
{{- end -}}

{{/* The kubelet's PodResources socket dir: the plugins, and katamgr (which GPUs pods hold). */}}
{{- define "ksm.podResourcesVolume" -}}
- name: pod-resources
  hostPath:
    path: {{ include "ksm.hostPath" (list . (printf "%s/pod-resources" (include "ksm.kubeletDir" .))) }}
    type: Directory
{{- end -}}

{{/*
The host directories the device plugin and the DRA driver need in the Shared NVSwitch model (devices.nvlinkFabric:
sharedNvswitch, or FM at a unix socket): katamgr's state dir, writable, for its record of the
active partitions (restored into FM after a restart); FM's socket's dir and the SDK library's,
read-only. As a JSON list; empty otherwise (FM over TCP needs the pod on the host's network).
*/}}
{{- define "ksm.fabricDirs" -}}
{{- $devices := .Values.devices | default dict -}}
{{- $fm := $devices.fabricManager | default dict -}}
{{- $dirs := list -}}
{{- $unix := hasPrefix "/" ($fm.address | default "") -}}
{{- if or (eq ($devices.nvlinkFabric | default "auto") "sharedNvswitch") $unix -}}
{{- $dirs = append $dirs "/var/lib/kata-sandbox-manager" -}}
{{- if $unix }}{{ $dirs = append $dirs (dir $fm.address) }}{{ end -}}
{{- if hasPrefix "/" ($fm.library | default "") }}{{ $dirs = append $dirs (dir $fm.library) }}{{ end -}}
{{- end -}}
{{- $dirs | uniq | toJson -}}
{{- end -}}
