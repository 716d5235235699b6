{{/*
Names and labels shared by every object of the chart.
*/}}

{{- define "ksm.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name; the release name alone when it already holds the chart name. */}}
{{- define "ksm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ksm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ksm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ksm.labels" -}}
{{ include "ksm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The one image: it holds both katamgr and sandbox-device-plugin. */}}
{{- define "ksm.image" -}}
{{- $v := .Values.kataManager -}}
{{- printf "%s/%s:%s" $v.repository $v.image (default .Chart.AppVersion $v.version) -}}
{{- end -}}

{{/* A host path below hostPaths.rootFS, as the kubelet sees it. Call with (list $ "/sys"). */}}
{{- define "ksm.hostPath" -}}
{{- $root := (index . 0).Values.hostPaths.rootFS | trimSuffix "/" -}}
{{- printf "%s%s" $root (index . 1) -}}
{{- end -}}

{{/* Where a host path is reachable inside our containers (--host-root /host). */}}
{{- define "ksm.inHost" -}}
{{- printf "/host%s" . -}}
{{- end -}}

{{/*
Which parts of the node agent run; the templates and the RBAC agree by asking here.
*/}}
{{- define "ksm.sandbox" -}}
{{- if .Values.sandboxWorkloads.enabled }}true{{ end -}}
{{- end -}}

{{- define "ksm.kata" -}}
{{- if and .Values.sandboxWorkloads.enabled .Values.kataManager.enabled }}true{{ end -}}
{{- end -}}

{{/* katamgr runs when it has at least one job on a vm-passthrough node. */}}
{{- define "ksm.agent" -}}
{{- $v := .Values -}}
{{- if and $v.sandboxWorkloads.enabled (or $v.kataManager.enabled $v.vfioManager.enabled $v.cdi.enabled) }}true{{ end -}}
{{- end -}}

{{- define "ksm.sandboxPlugin" -}}
{{- if and .Values.sandboxWorkloads.enabled .Values.sandboxDevicePlugin.enabled }}true{{ end -}}
{{- end -}}

{{/*
Node affinity for GPU nodes running one workload type. A node without the
nvidia.com/gpu.workload.config label runs sandboxWorkloads.defaultWorkload, so the
default workload matches with NotIn (which also matches an absent label) and any other
workload with In. With sandbox workloads off every GPU node is a container node.
Call with (list $ "vm-passthrough").
*/}}
{{- define "ksm.nodeAffinity" -}}
{{- $root := index . 0 -}}
{{- $workload := index . 1 -}}
{{- $sandbox := $root.Values.sandboxWorkloads -}}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
      - matchExpressions:
          - key: nvidia.com/gpu.present
            operator: In
            values: ["true"]
          {{- if $sandbox.enabled }}
          {{- if eq $sandbox.defaultWorkload $workload }}
          {{- $others := without (list "container" "vm-passthrough" "vm-vgpu") $workload }}
          - key: nvidia.com/gpu.workload.config
            operator: NotIn
            values: {{ $others | toJson }}
          {{- else }}
          - key: nvidia.com/gpu.workload.config
            operator: In
            values: [{{ $workload | quote }}]
          {{- end }}
          {{- end }}
{{- end -}}

{{/*
Host dirs holding OCI image layouts (air-gapped artifacts), one per line: the
kataManager.ociLayoutDirs plus the layout dir of every oci-layout:// artifact URL
(oci-layout://PATH[:TAG] or oci-layout://PATH@DIGEST, parsed as katamgr does). katamgr
reads them below --host-root, so each is mounted read-only at /host<dir>. A dir already
reachable (equal to or below another listed dir or the artifacts dir) is left out: two
mounts at one path are refused by the API server.
*/}}
{{- define "ksm.ociLayoutDirs" -}}
{{- $kata := .Values.kataManager -}}
{{- $dirs := list -}}
{{- range $kata.ociLayoutDirs -}}
{{- $dirs = append $dirs (trimSuffix "/" .) -}}
{{- end -}}
{{- range $i, $rc := $kata.config.runtimeClasses -}}
{{- $url := $rc.artifacts.url | trim -}}
{{- if hasPrefix "oci-layout://" $url -}}
{{- $path := trimPrefix "oci-layout://" $url -}}
{{- if contains "@" $path -}}
{{- $path = regexReplaceAll "@[^@]*$" $path "" -}}
{{- else -}}
{{- $path = regexReplaceAll ":[^:/]*$" $path "" -}}
{{- end -}}
{{- $path = trimSuffix "/" $path -}}
{{- if or (not (hasPrefix "/" $path)) (regexMatch "(^|/)\\.\\.(/|$)" $path) -}}
{{- fail (printf "kataManager.config.runtimeClasses[%d].artifacts.url %q names the layout dir %q, which is not an absolute host path without '..'; write oci-layout:///absolute/dir:TAG" $i $url $path) -}}
{{- end -}}
{{- $dirs = append $dirs $path -}}
{{- end -}}
{{- end -}}
{{- $artifactsDir := $kata.config.artifactsDir | trimSuffix "/" -}}
{{- $kept := list -}}
{{- range $dir := $dirs | uniq -}}
{{- $covered := eq $dir $artifactsDir -}}
{{- range $other := append $dirs $artifactsDir -}}
{{- if hasPrefix (printf "%s/" $other) $dir -}}
{{- $covered = true -}}
{{- end -}}
{{- end -}}
{{- if not $covered -}}
{{- $kept = append $kept $dir -}}
{{- end -}}
{{- end -}}
{{- $kept | join "\n" -}}
{{- end -}}

{{/* Pod-level settings every DaemonSet shares. */}}
{{- define "ksm.podCommon" -}}
serviceAccountName: {{ include "ksm.fullname" . }}
priorityClassName: {{ .Values.daemonsets.priorityClassName }}
{{- with .Values.daemonsets.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.kataManager.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "ksm.updateStrategy" -}}
updateStrategy:
  type: {{ .Values.daemonsets.updateStrategy }}
  {{- if eq .Values.daemonsets.updateStrategy "RollingUpdate" }}
  rollingUpdate:
    maxUnavailable: {{ .Values.daemonsets.rollingUpdate.maxUnavailable }}
  {{- end }}
{{- end -}}

{{/* The downward-API env both commands read. */}}
{{- define "ksm.nodeEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/*
Kubelet sockets every device-plugin container needs: its own registration dir, and
pod-resources (read-only: connecting to a unix socket works on a read-only mount).
*/}}
{{- define "ksm.kubeletMounts" -}}
- name: device-plugins
  mountPath: {{ include "ksm.inHost" "/var/lib/kubelet/device-plugins" }}
- name: pod-resources
  mountPath: {{ include "ksm.inHost" "/var/lib/kubelet/pod-resources" }}
  readOnly: true
{{- end -}}

{{- define "ksm.kubeletVolumes" -}}
- name: device-plugins
  hostPath:
    path: {{ include "ksm.hostPath" (list . "/var/lib/kubelet/device-plugins") }}
    type: Directory
- name: pod-resources
  hostPath:
    path: {{ include "ksm.hostPath" (list . "/var/lib/kubelet/pod-resources") }}
    type: Directory
{{- end -}}

{{/*
The device plugin only serves sockets and reads files: root (the kubelet's directories
are root-owned) but without any capability.
*/}}
{{- define "ksm.pluginSecurityContext" -}}
securityContext:
  runAsUser: 0
  privileged: false
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}
