{{/*
What the chart's DaemonSets share in their pods and containers: the pod-level settings
(ksm.podCommon), node affinity, update strategy, pull policies, the downward-API env,
resources, the metrics port and probes, and the device plugins' security context.
*/}}

{{/*
Pod-level settings every DaemonSet shares, the RuntimeDefault seccomp profile among them. Call with (list $ SECRETS SERVICEACCOUNT TOKEN):
SECRETS are the imagePullSecrets of the operands the pod runs, added to image.pullSecrets;
SERVICEACCOUNT is the workload's own (ksm.serviceAccountName: one per workload, each with
only the rights its pods use); TOKEN false: the pod calls no API, so it is given no token
at all (automountServiceAccountToken: false) and a process that takes the pod over has no
identity to use either.
*/}}
{{- define "ksm.podCommon" -}}
{{- $root := index . 0 -}}
{{- $secrets := concat ($root.Values.image.pullSecrets | default list) (index . 1) | uniq -}}
serviceAccountName: {{ index . 2 }}
{{- if not (index . 3) }}
automountServiceAccountToken: false
{{- end }}
priorityClassName: {{ $root.Values.daemonsets.priorityClassName }}
# The runtime's default seccomp profile for every container (a privileged one runs without
# any: the runtime applies none to it).
securityContext:
  seccompProfile:
    type: RuntimeDefault
{{- with $root.Values.daemonsets.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $secrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
The pod affinity of a DaemonSet: GPU nodes (gpuNodeSelector, the GPU Operator's
nvidia.com/gpu.present=true by default), then optionally one workload and one GPU Operator
operand the node may opt out of. A node without the nvidia.com/gpu.workload.config label
runs sandboxWorkloads.defaultWorkload, so the default workload matches with NotIn (which
also matches an absent label) and any other workload with In; with sandbox workloads off
every GPU node is a container node. OPERAND (e.g. "device-plugin") keeps the pod off a
node labeled nvidia.com/gpu.deploy.<operand>=false or nvidia.com/gpu.deploy.operands=false,
as the GPU Operator's own DaemonSets stay off it. Renders the whole `affinity:` block,
or nothing when there is nothing to select on (an empty term would match no node).
Call with (list $ WORKLOAD OPERAND); "" for either: any. WORKLOAD may be a list of workloads
(the container plugin on container and split vm-passthrough nodes): matched as one.
*/}}
{{- define "ksm.nodeAffinity" -}}
{{- $root := index . 0 -}}
{{- $workload := index . 1 -}}
{{- $operand := index . 2 -}}
{{- $sandbox := $root.Values.sandboxWorkloads -}}
{{- $exprs := list -}}
{{- range $key, $value := ($root.Values.gpuNodeSelector | default dict) -}}
{{- $exprs = append $exprs (dict "key" $key "operator" "In" "values" (list (toString $value))) -}}
{{- end -}}
{{- if and $sandbox.enabled $workload -}}
{{- $served := ternary $workload (list $workload) (kindIs "slice" $workload) -}}
{{- if has $sandbox.defaultWorkload $served -}}
{{- $others := list -}}
{{- range list "container" "vm-passthrough" "vm-vgpu" -}}
{{- if not (has . $served) }}{{ $others = append $others . }}{{ end -}}
{{- end -}}
{{- $exprs = append $exprs (dict "key" "nvidia.com/gpu.workload.config" "operator" "NotIn" "values" $others) -}}
{{- else -}}
{{- $exprs = append $exprs (dict "key" "nvidia.com/gpu.workload.config" "operator" "In" "values" $served) -}}
{{- end -}}
{{- end -}}
{{- if $operand -}}
{{- range $key := list (printf "nvidia.com/gpu.deploy.%s" $operand) "nvidia.com/gpu.deploy.operands" -}}
{{- $exprs = append $exprs (dict "key" $key "operator" "NotIn" "values" (list "false")) -}}
{{- end -}}
{{- end -}}
{{- if $exprs -}}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            {{- toYaml $exprs | nindent 12 }}
{{- end -}}
{{- end -}}

{{- /* The rollout node by node: minReadySeconds and the strategy (values.yaml, daemonsets).
Called with the root, or (list root "surge") by the container device plugin's DaemonSet: its new
pod starts beside the old one (maxSurge, the same count; maxUnavailable 0) and registers with the
kubelet, and the old one is deleted once the new one is Ready, so nvidia.com/gpu keeps a plugin
through the rollout (but for the moment the old pod's end drops the new one's connection and it
registers again: sandbox_plugin.server). No minReadySeconds there: kube-controller-manager's
DaemonSet controller (v1.35.4, daemon_controller.go updateDaemonSetStatus) counts only a node's
oldest pod, so it does not look again by itself once a surged pod has been Ready minReadySeconds, and the old
pod would stay. The sandbox agent's pod never surges: one katamgr per node (its node lock), and its
offer gate holds Kata pods back while it is replaced. */}}
{{- define "ksm.updateStrategy" -}}
{{- $root := . }}{{ $surge := false }}
{{- if kindIs "slice" . }}{{ $root = index . 0 }}{{ $surge = true }}{{ end }}
{{- $d := $root.Values.daemonsets }}
minReadySeconds: {{ if $surge }}0{{ else }}{{ $d.minReadySeconds | default 0 | int }}{{ end }}
updateStrategy:
  type: {{ $d.updateStrategy }}
  {{- if eq $d.updateStrategy "RollingUpdate" }}
  rollingUpdate:
    {{- if $surge }}
    maxSurge: {{ $d.rollingUpdate.maxUnavailable }}
    maxUnavailable: 0
    {{- else }}
    maxUnavailable: {{ $d.rollingUpdate.maxUnavailable }}
    {{- end }}
  {{- end }}
{{- end -}}

{{/*
A container's pull policy: the first imagePullPolicy set in the value blocks feeding it (the
operand's own, then the GPU Operator's for the same container), else image.pullPolicy. Call
with (list $ BLOCK...): katamgr's are kataManager, vfioManager, ccManager; the passthrough
plugin's sandboxDevicePlugin, kataSandboxDevicePlugin; the container plugin's devicePlugin.
*/}}
{{- define "ksm.pullPolicy" -}}
{{- $values := (first .).Values -}}
{{- $policy := "" -}}
{{- range rest . }}{{ $policy = $policy | default (dig "imagePullPolicy" "" (index $values . | default dict)) }}{{ end -}}
{{- $policy | default $values.image.pullPolicy -}}
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

{{/* A container's resources: the first non-empty of the candidates, else nothing. Call with a list. */}}
{{- define "ksm.resources" -}}
{{- $found := dict -}}
{{- range . -}}
{{- if and (empty $found) (not (empty .)) }}{{ $found = . }}{{ end -}}
{{- end -}}
{{- with $found -}}
resources:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
The metrics port and the probes of a container serving --metrics-address (dict: root,
port, name, startupSeconds; port as for ksm.metricsArgs: "agentPort" or "pluginPort"). /healthz (the loop is alive) for the startup and liveness
probes, /readyz (the work is done) for readiness. The startup probe only covers the
process coming up to the point where it serves (import, flags, the cluster client); from
then on /healthz answers ok during a long reconcile too (katamgr: up to an hour, e.g.
pulling artifacts), so liveness never kills a pod that is still pulling; readiness is
the probe that waits, and keeps a rolling update from moving on until the node is done.
*/}}
{{- define "ksm.metricsContainer" -}}
{{- if include "ksm.metricsOn" .root -}}
{{- $port := dig .port 0 .root.Values.metrics -}}
ports:
  - name: {{ .name }}
    containerPort: {{ $port }}
    protocol: TCP
startupProbe:
  httpGet:
    path: /healthz
    port: {{ .name }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ div .startupSeconds 5 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .name }}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .name }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}
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
