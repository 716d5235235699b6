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

{{/*
The one image: it holds both katamgr and sandbox-device-plugin. Only the top-level image
block names it; the GPU Operator's repository/image/version keys never do. By tag
(repository/name:tag, the appVersion when tag is empty), or with image.digest set by digest
alone (repository/name@sha256:...): the tag is then not rendered, since the runtime would
pull by the digest and ignore it, and a tag beside it could name another image than the one
run. A bad digest fails here too, for a render that skipped the schema.
*/}}
{{- define "ksm.image" -}}
{{- $i := .Values.image -}}
{{- if $i.digest -}}
{{- if not (regexMatch "^sha256:[a-f0-9]{64}$" $i.digest) -}}
{{- fail (printf "image.digest=%q is not an image digest: sha256: and 64 lowercase hex digits (the Digest skopeo inspect prints for the published tag)" $i.digest) -}}
{{- end -}}
{{- printf "%s/%s@%s" $i.repository $i.name $i.digest -}}
{{- else -}}
{{- printf "%s/%s:%s" $i.repository $i.name (default .Chart.AppVersion $i.tag) -}}
{{- end -}}
{{- end -}}

{{/*
A GPU Operator block that values.yaml may leave out (kataSandboxDevicePlugin, ccManager):
the block, or an empty dict. Call with (list $ "kataSandboxDevicePlugin").
*/}}
{{- define "ksm.block" -}}
{{- toJson (index (index . 0).Values (index . 1) | default dict) -}}
{{- end -}}

{{/*
The containers' pull policies: an operand's imagePullPolicy, else that of the GPU Operator
block feeding the same container, else image.pullPolicy.
*/}}
{{- define "ksm.agentPullPolicy" -}}
{{- $cc := include "ksm.block" (list . "ccManager") | fromJson -}}
{{- coalesce .Values.kataManager.imagePullPolicy .Values.vfioManager.imagePullPolicy $cc.imagePullPolicy .Values.image.pullPolicy -}}
{{- end -}}

{{/*
The CC manager (ccManager.enabled with sandbox workloads on): "true" or "". Its default mode:
DEFAULT_CC_MODE from ccManager.env (NVIDIA's cc-manager reads that), else defaultMode.
*/}}
{{- define "ksm.ccManager" -}}
{{- $cc := include "ksm.block" (list . "ccManager") | fromJson -}}
{{- if and .Values.sandboxWorkloads.enabled $cc.enabled }}true{{ end -}}
{{- end -}}

{{/* The agent publishes the GPU labels (gpuLabels.enabled, on by default): "true" or "". */}}
{{- define "ksm.gpuLabels" -}}
{{- if and (include "ksm.agent" .) (dig "enabled" true (.Values.gpuLabels | default dict)) }}true{{ end -}}
{{- end -}}

{{/* The uninstall hook's katamgr revert takes labels the agent set off its Node: the GPU
labels (gpuLabels.enabled) and the runtime classes' offer labels (kataManager): "true" or "". */}}
{{- define "ksm.revertWritesNode" -}}
{{- if or (include "ksm.gpuLabels" .) (and (include "ksm.agent" .) (include "ksm.kata" .)) }}true{{ end -}}
{{- end -}}

{{- define "ksm.ccDefaultMode" -}}
{{- $cc := include "ksm.block" (list . "ccManager") | fromJson -}}
{{- $mode := $cc.defaultMode | default "on" -}}
{{- range ($cc.env | default list) }}{{ if eq .name "DEFAULT_CC_MODE" }}{{ $mode = .value }}{{ end }}{{ end -}}
{{- $mode -}}
{{- end -}}

{{- define "ksm.pluginPullPolicy" -}}
{{- $k := include "ksm.block" (list . "kataSandboxDevicePlugin") | fromJson -}}
{{- coalesce .Values.sandboxDevicePlugin.imagePullPolicy $k.imagePullPolicy .Values.image.pullPolicy -}}
{{- end -}}

{{- define "ksm.devicePluginPullPolicy" -}}
{{- coalesce .Values.devicePlugin.imagePullPolicy .Values.image.pullPolicy -}}
{{- end -}}

{{/*
The aliases NVIDIA's sandbox device plugin reads from its env, as this chart's arguments
(empty: model names). --alias: sandboxDevicePlugin.alias, else P_GPU_ALIAS from
sandboxDevicePlugin.env, else from kataSandboxDevicePlugin.env; --nvswitch-alias:
NVSWITCH_ALIAS, looked up the same way. As JSON {"P_GPU_ALIAS": .., "NVSWITCH_ALIAS": ..}.
*/}}
{{- define "ksm.aliases" -}}
{{- $k := include "ksm.block" (list . "kataSandboxDevicePlugin") | fromJson -}}
{{- $out := dict -}}
{{- range (concat (.Values.sandboxDevicePlugin.env | default list) ($k.env | default list)) -}}
{{- if and (has .name (list "P_GPU_ALIAS" "NVSWITCH_ALIAS")) (not (hasKey $out .name)) -}}
{{- $_ := set $out .name (.value | default "") -}}
{{- end -}}
{{- end -}}
{{- with .Values.sandboxDevicePlugin.alias }}{{ $_ := set $out "P_GPU_ALIAS" . }}{{ end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
The naming arguments (resource naming and the aliases, see ksm.aliases). Every program that
names devices gets them alike: katamgr writes one CDI spec per advertised resource, named
like the resource; the uninstall revert finds those specs by them.
*/}}
{{- define "ksm.namingArgs" -}}
{{- $aliases := include "ksm.aliases" . | fromJson -}}
- --resource-naming
- {{ .Values.sandboxDevicePlugin.resourceNaming }}
{{- with $aliases.P_GPU_ALIAS }}
- --alias
- {{ . }}
{{- end }}
{{- with $aliases.NVSWITCH_ALIAS }}
- --nvswitch-alias
- {{ . }}
{{- end }}
{{- end -}}

{{/*
The options katamgr, sandbox-device-plugin and sandbox-dra-driver share
(gpunode.services.options: one spelling, one default and one check for the three), each
value passed as the values file writes it: the host (hostPaths.rootFS is where containerd
sees the node's /), the node and the workload of a node without the
nvidia.com/gpu.workload.config label (the same default the container plugin's node
affinity schedules by), the log format, the device names, the device selection
(devices.include, exclude, nvswitches: auto, true or false; kataVersion, empty: found on
the node) and the NVLink fabric (devices.nvlinkFabric, devices.fabricManager). They must
agree: the plugins advertise exactly the devices katamgr binds and writes CDI specs for.
*/}}
{{- define "ksm.nodeArgs" -}}
{{- $devices := .Values.devices | default dict -}}
{{- $fm := $devices.fabricManager | default dict -}}
{{- $nvswitches := $devices.nvswitches -}}
{{- if kindIs "invalid" $nvswitches }}{{ $nvswitches = "auto" }}{{ end -}}
- --host-root
- /host
- --runtime-root
- {{ .Values.hostPaths.rootFS | quote }}
- --node-name
- $(NODE_NAME)
- --default-workload
- {{ .Values.sandboxWorkloads.defaultWorkload }}
{{ include "ksm.logArgs" . }}
{{ include "ksm.namingArgs" . }}
{{- range ($devices.include | default list) }}
- --include-device
- {{ printf "%s=%s" .ids .resource | quote }}
{{- end }}
{{- range ($devices.exclude | default list) }}
- --exclude-device
- {{ . | quote }}
{{- end }}
- --nvswitches
- {{ $nvswitches | toString | quote }}
- --kata-version
- {{ $devices.kataVersion | default "" | quote }}
- --nvlink-fabric
- {{ $devices.nvlinkFabric | default "auto" | quote }}
- --fabric-manager-address
- {{ $fm.address | default "" | quote }}
- --fabric-manager-library
- {{ $fm.library | default "" | quote }}
- --gpu-module-ids
- {{ $fm.gpuModuleIds | default "" | quote }}
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

{{/*
The sandbox-device-plugin container's env: sandboxDevicePlugin.env, then the entries of
kataSandboxDevicePlugin.env it does not name, less P_GPU_ALIAS and NVSWITCH_ALIAS
(arguments instead, see ksm.aliases). As a JSON list.
*/}}
{{- define "ksm.pluginEnv" -}}
{{- $k := include "ksm.block" (list . "kataSandboxDevicePlugin") | fromJson -}}
{{- $aliases := list "P_GPU_ALIAS" "NVSWITCH_ALIAS" -}}
{{- $env := list -}}
{{- $names := list -}}
{{- range (.Values.sandboxDevicePlugin.env | default list) -}}
{{- if not (has .name $aliases) }}{{ $env = append $env . }}{{ $names = append $names .name }}{{ end -}}
{{- end -}}
{{- range ($k.env | default list) -}}
{{- if not (has .name (concat $aliases $names)) }}{{ $env = append $env . }}{{ end -}}
{{- end -}}
{{- toJson $env -}}
{{- end -}}

{{/*
GPU Operator values this chart accepts but does not apply, one "path" per line, for
NOTES.txt. A key counts when set to anything but false, "", [] or {}; a key that another
block overrides for the same container counts when it differs from the value used.
*/}}
{{/*
The image and artifact references that name a documentation placeholder host (RFC 2606:
example.com, example.org, example.net and their subdomains, as the shipped examples do),
one a line: no node can pull from them.
*/}}
{{- define "ksm.placeholderRefs" -}}
{{- $host := "^([a-z0-9-]+[.])*example[.](com|org|net)([:/]|$)" -}}
{{- $image := printf "%s/%s" .Values.image.repository .Values.image.name -}}
{{- if regexMatch $host $image }}image (image.repository): {{ $image }}
{{ end -}}
{{- if include "ksm.kata" . -}}
{{- range (.Values.kataManager.config.runtimeClasses | default list) -}}
{{- $url := dig "artifacts" "url" "" . -}}
{{- if regexMatch $host $url }}runtime class {{ .name }}'s artifacts: {{ $url }}
{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ksm.ignoredValues" -}}
{{- $v := .Values -}}
{{- $k := include "ksm.block" (list . "kataSandboxDevicePlugin") | fromJson -}}
{{- $blocks := dict "kataManager" $v.kataManager "vfioManager" $v.vfioManager
      "sandboxDevicePlugin" $v.sandboxDevicePlugin "kataSandboxDevicePlugin" $k
      "devicePlugin" $v.devicePlugin -}}
{{- $out := list -}}
{{- $cc := include "ksm.block" (list . "ccManager") | fromJson -}}
{{- range $key := list "repository" "image" "version" -}}
{{- if not (empty (index $cc $key)) }}{{ $out = append $out (printf "ccManager.%s" $key) }}{{ end -}}
{{- end -}}
{{- range $name := list "kataManager" "vfioManager" "sandboxDevicePlugin" "kataSandboxDevicePlugin" "devicePlugin" -}}
{{- $block := index $blocks $name -}}
{{- range $key := list "repository" "image" "version" "args" "hostNetwork" -}}
{{- if not (empty (index $block $key)) }}{{ $out = append $out (printf "%s.%s" $name $key) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- /* NVIDIA's k8s-driver-manager, which this chart does not run. */ -}}
{{- range $key := list "env" "driverManager" -}}
{{- if not (empty (index $v.vfioManager $key)) }}{{ $out = append $out (printf "vfioManager.%s" $key) }}{{ end -}}
{{- end -}}
{{- /* Overridden for the same container by the chart's own block. */ -}}
{{- range $pair := list (list "kataManager" "vfioManager") (list "sandboxDevicePlugin" "kataSandboxDevicePlugin") -}}
{{- $winner := index $blocks (index $pair 0) -}}
{{- $loser := index $blocks (index $pair 1) -}}
{{- range $key := list "resources" "imagePullPolicy" -}}
{{- $used := index $winner $key -}}
{{- $lost := index $loser $key -}}
{{- if and (not (empty $used)) (not (empty $lost)) (ne (toJson $used) (toJson $lost)) -}}
{{- $out = append $out (printf "%s.%s" (index $pair 1) $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $aliases := include "ksm.aliases" . | fromJson -}}
{{- $ownEnv := list -}}
{{- range ($v.sandboxDevicePlugin.env | default list) -}}
{{- $ownEnv = append $ownEnv .name -}}
{{- if and (hasKey $aliases .name) (ne (index $aliases .name) (.value | default "")) -}}
{{- $out = append $out (printf "sandboxDevicePlugin.env %s" .name) -}}
{{- end -}}
{{- end -}}
{{- range ($k.env | default list) -}}
{{- if hasKey $aliases .name -}}
{{- if ne (index $aliases .name) (.value | default "") }}{{ $out = append $out (printf "kataSandboxDevicePlugin.env %s" .name) }}{{ end -}}
{{- else if has .name $ownEnv -}}
{{- $out = append $out (printf "kataSandboxDevicePlugin.env %s" .name) -}}
{{- end -}}
{{- end -}}
{{- range $key := list "config" "mps" -}}
{{- if not (empty (index $v.devicePlugin $key)) }}{{ $out = append $out (printf "devicePlugin.%s" $key) }}{{ end -}}
{{- end -}}
{{- range $key := list "default" "nriPluginEnabled" -}}
{{- if not (empty (index $v.cdi $key)) }}{{ $out = append $out (printf "cdi.%s" $key) }}{{ end -}}
{{- end -}}
{{- if not (empty $v.hostPaths.driverInstallDir) }}{{ $out = append $out "hostPaths.driverInstallDir" }}{{ end -}}
{{- $out | join "\n" -}}
{{- end -}}

{{/* Values refused at render time, where the schema cannot say why. */}}
{{- define "ksm.validate" -}}
{{- if eq (toString .Values.sandboxWorkloads.mode) "kubevirt" -}}
{{- fail "sandboxWorkloads.mode=kubevirt: this chart runs Kata Containers only; use the NVIDIA GPU Operator for KubeVirt, or set sandboxWorkloads.mode=kata (the default)" -}}
{{- end -}}
{{- if eq (toString .Values.sandboxWorkloads.defaultWorkload) "vm-vgpu" -}}
{{- fail "sandboxWorkloads.defaultWorkload=vm-vgpu: this chart does not run NVIDIA vGPU, so every GPU node without a workload label would get nothing from it (no GPU bound, none advertised); serve vGPU nodes with the NVIDIA GPU Operator, and set defaultWorkload to container (the default) or vm-passthrough" -}}
{{- end -}}
{{- /* (| default: a release upgraded with --reuse-values from before these values existed) */ -}}
{{- $m := .Values.metrics | default dict -}}
{{- if and (dig "serviceMonitor" "enabled" false $m) (not (include "ksm.metricsOn" .)) -}}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.enabled=true: with metrics off there is nothing to scrape" -}}
{{- end -}}
{{- if and (include "ksm.dra" .) (semverCompare "<1.34-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "dra.enabled=true needs Kubernetes 1.34 or later (ResourceSlices, ResourceClaims and DeviceClasses of resource.k8s.io/v1); this cluster is %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if has (dig "driverName" "" (.Values.dra | default dict)) (list "gpu.nvidia.com" "compute-domain.nvidia.com") -}}
{{- fail (printf "dra.driverName=%s is a driver name of NVIDIA's DRA driver for GPUs; give this chart's passthrough driver its own (default passthrough.kata-sandbox-manager.io)" .Values.dra.driverName) -}}
{{- end -}}
{{- $cc := include "ksm.block" (list . "ccManager") | fromJson -}}
{{- if and $cc.enabled .Values.sandboxWorkloads.enabled (not .Values.vfioManager.enabled) -}}
{{- fail "ccManager.enabled=true needs vfioManager.enabled=true: a CC mode switch unbinds and resets the GPUs, which only the privileged agent container (vfioManager) may do" -}}
{{- end -}}
{{- if not (has (include "ksm.ccDefaultMode" .) (list "on" "off" "devtools" "ppcie")) -}}
{{- fail (printf "ccManager: the default CC mode %q (defaultMode, or DEFAULT_CC_MODE in ccManager.env) is not one of on, off, devtools, ppcie" (include "ksm.ccDefaultMode" .)) -}}
{{- end -}}
{{- /* The rest refuses what the CC manager, once enabled, could not honour. */ -}}
{{- if $cc.enabled -}}
{{- range ($cc.env | default list) -}}
{{- if ne .name "DEFAULT_CC_MODE" -}}
{{- fail (printf "ccManager.env %s: only DEFAULT_CC_MODE is read (as NVIDIA's cc-manager reads it); katamgr evicts no GPU Operator component for a switch (it waits until no VM or pod holds a GPU), so EVICT_OPERATOR_COMPONENTS and OPERATOR_NAMESPACE have nothing to set, and it takes each GPU's CC capability from NVIDIA's gpu-admin-tools (Hopper and later), so CC_CAPABLE_DEVICE_IDS has none either" .name) -}}
{{- end -}}
{{- end -}}
{{- if $cc.args -}}
{{- fail (printf "ccManager.args %v: NVIDIA's cc-manager command line; this chart's agent does the CC manager's job with its own options (ccManager.enabled, defaultMode)" $cc.args) -}}
{{- end -}}
{{- if $cc.hostNetwork -}}
{{- fail "ccManager.hostNetwork=true: no pod of this chart uses the host's network, and switching CC modes needs none" -}}
{{- end -}}
{{- if or (and $cc.repository (ne (toString $cc.repository) "nvcr.io/nvidia/cloud-native")) (and $cc.image (ne (toString $cc.image) "k8s-cc-manager")) -}}
{{- fail (printf "ccManager.repository/image %s/%s: this chart does the CC manager's job in its own agent (katamgr run --cc-manager), so only NVIDIA's nvcr.io/nvidia/cloud-native/k8s-cc-manager may be named (and is listed as replaced); a different cc-manager image cannot run here" (toString $cc.repository) (toString $cc.image)) -}}
{{- end -}}
{{- end -}}
{{- if and (include "ksm.metricsOn" .) (eq (int $m.agentPort) (int $m.pluginPort)) -}}
{{- fail (printf "metrics.agentPort and metrics.pluginPort are both %d: the sandbox agent pod runs both containers, so they need two ports" (int $m.agentPort)) -}}
{{- end -}}
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

{{/* kataManager.planOnly: the agent only works out and publishes the node's plan (katamgr run
       --plan-only), on the host mounted read-only; nothing else of the sandbox agent runs. */}}
{{- define "ksm.planOnly" -}}
{{- if and (include "ksm.agent" .) .Values.kataManager.planOnly }}true{{ end -}}
{{- end -}}

{{/* Off when either sandboxDevicePlugin.enabled or the GPU Operator's kataSandboxDevicePlugin.enabled
       is false, and when the DRA driver serves the passthrough devices instead (dra.enabled). */}}
{{- define "ksm.sandboxPlugin" -}}
{{- $k := include "ksm.block" (list . "kataSandboxDevicePlugin") | fromJson -}}
{{- if and .Values.sandboxWorkloads.enabled .Values.sandboxDevicePlugin.enabled (dig "enabled" true $k) (not (include "ksm.dra" .)) }}true{{ end -}}
{{- end -}}

{{/* The DRA driver (sandbox-dra-driver) in the sandbox agent pod, in place of the sandbox
       device plugin: one or the other publishes a node's passthrough devices, never both.
       (| default: a release upgraded with --reuse-values from before dra existed) */}}
{{- define "ksm.dra" -}}
{{- if and .Values.sandboxWorkloads.enabled (dig "enabled" false (.Values.dra | default dict)) }}true{{ end -}}
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
Call with (list $ WORKLOAD OPERAND); "" for either: any.
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
{{- if eq $sandbox.defaultWorkload $workload -}}
{{- $exprs = append $exprs (dict "key" "nvidia.com/gpu.workload.config" "operator" "NotIn" "values" (without (list "container" "vm-passthrough" "vm-vgpu") $workload)) -}}
{{- else -}}
{{- $exprs = append $exprs (dict "key" "nvidia.com/gpu.workload.config" "operator" "In" "values" (list $workload)) -}}
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

{{/*
Pod-level settings every DaemonSet shares. Call with (list $ SECRETS SERVICEACCOUNT TOKEN):
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
The ServiceAccount of one workload of the chart: <fullname>-<workload> (sandbox-agent,
device-plugin, webhook, revert, revert-wait). Call with (list $ WORKLOAD). fullname is at
most 40 characters, so every name stays within 63 characters.
*/}}
{{- define "ksm.serviceAccountName" -}}
{{- printf "%s-%s" (include "ksm.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* "true" when the sandbox-agent DaemonSet is rendered: katamgr run, the passthrough
       device plugin or the DRA driver (sandbox-daemonset.yaml asks the same). */}}
{{- define "ksm.sandboxAgentPod" -}}
{{- if or (include "ksm.agent" .) (include "ksm.sandboxPlugin" .) (include "ksm.dra" .) }}true{{ end -}}
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

{{/*
The namespaceSelector of the isolation webhook and policy: the user's selector with the
release namespace and isolation.excludedNamespaces (default kube-system, gpu-operator)
excluded, and every namespace labeled isolation.kata-sandbox-manager.io/exempt=true.
*/}}
{{- define "ksm.isolationNamespaceSelector" -}}
{{- $root := index . 0 -}}
{{- $selector := deepCopy (index . 1 | default dict) -}}
{{- $excluded := concat (list $root.Release.Namespace) ($root.Values.isolation.excludedNamespaces | default list) | uniq -}}
{{- $exempt := dict "key" "isolation.kata-sandbox-manager.io/exempt" "operator" "NotIn" "values" (list "true") -}}
{{- $exprs := concat ($selector.matchExpressions | default list) (list (dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" $excluded) $exempt) -}}
{{- $_ := set $selector "matchExpressions" $exprs -}}
{{- toYaml $selector -}}
{{- end -}}

{{/*
The resources devices.include advertises, as a JSON list. Each is a passthrough resource
whatever its domain: the isolation webhook (--passthrough-resource) and the admission
policy guard them without the operator listing them in isolation.passthroughResources.
(A resource name holds no glob character, so as a webhook pattern it matches itself only.)
*/}}
{{- define "ksm.includedResources" -}}
{{- $out := list -}}
{{- range ((.Values.devices | default dict).include | default list) }}
{{- $out = append $out .resource -}}
{{- end -}}
{{- $out | uniq | toJson -}}
{{- end -}}

{{/*
"true" when the cluster serves admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy
(Kubernetes 1.30+), as Helm learns from the API server at install and upgrade. helm template
knows only what --api-versions tells it.
*/}}
{{- define "ksm.admissionPolicyServed" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
true
{{- end -}}
{{- end -}}

{{/*
The admission requests both isolation layers look at: a Pod's CREATE, and the UPDATE of its
pods/ephemeralcontainers subresource (kubectl debug). Never a plain Pod UPDATE: a container's
env cannot change after create, so a pod made before the install must stay updatable.
*/}}
{{- define "ksm.podAdmissionRules" -}}
resourceRules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["pods"]
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["UPDATE"]
    resources: ["pods/ephemeralcontainers"]
{{- end -}}

{{/* An admission policy binding's matchResources (list: root, the policy's values). */}}
{{- define "ksm.policyMatchResources" -}}
{{- $p := index . 1 -}}
namespaceSelector:
  {{- include "ksm.isolationNamespaceSelector" (list (index . 0) $p.namespaceSelector) | nindent 2 }}
objectSelector:
  {{- toYaml ($p.objectSelector | default dict) | nindent 2 }}
{{- end -}}

{{/*
CEL: whether the string variable named (list root NAME) is a GPU's resource name or CDI
kind: nvidia.com/*, or a resource devices.include advertises (the webhook's is_gpu and
names_gpu with its default patterns).
*/}}
{{- define "ksm.policyGpuKind" -}}
{{- $v := index . 1 -}}
{{- $included := include "ksm.includedResources" (index . 0) -}}
{{- if eq $included "[]" -}}
{{ $v }}.startsWith('nvidia.com/')
{{- else -}}
({{ $v }}.startsWith('nvidia.com/') || {{ $v }} in {{ $included }})
{{- end -}}
{{- end -}}

{{/* CEL: params (a RuntimeClass) has a handler one of the patterns given allows (a name,
or a prefix ending in *): isolation.kataHandlers or isolation.kataGpuHandlers. */}}
{{- define "ksm.policyHandlerIn" -}}
{{- $out := list -}}
{{- range . -}}
{{- if hasSuffix "*" . -}}
{{- $out = append $out (printf "params.handler.startsWith(%s)" (trimSuffix "*" . | squote)) -}}
{{- else -}}
{{- $out = append $out (printf "params.handler == %s" (squote .)) -}}
{{- end -}}
{{- end -}}
({{ join " || " $out | default "false" }})
{{- end -}}

{{/*
The variables both admission policies share: which containers are looked at (all on a
create; the ephemeral ones on pods/ephemeralcontainers), the passthrough requests, the
runtime class, and the containers that ask for a GPU (a GPU resource, or a ResourceClaim).
*/}}
{{- define "ksm.policyVariables" -}}
{{- $pt := printf "%s && !(k in ['nvidia.com/gpu', 'nvidia.com/gpu.shared']) && !k.startsWith('nvidia.com/mig-')" (include "ksm.policyGpuKind" (list . "k")) -}}
{{- $gpu := include "ksm.policyGpuKind" (list . "k") -}}
- name: ephemeral
  expression: >-
    has(request.subResource) && request.subResource == 'ephemeralcontainers'
- name: initContainers
  expression: >-
    has(object.spec.initContainers) ? object.spec.initContainers : []
- name: ephemeralContainers
  expression: >-
    has(object.spec.ephemeralContainers) ? object.spec.ephemeralContainers : []
- name: containers
  expression: >-
    variables.ephemeral ? [] : variables.initContainers + object.spec.containers
- name: scoped
  expression: >-
    variables.ephemeral ? variables.ephemeralContainers :
    variables.initContainers + object.spec.containers + variables.ephemeralContainers
- name: passthrough
  expression: >-
    variables.containers.filter(c, has(c.resources) &&
    ((has(c.resources.limits) && c.resources.limits.exists(k, {{ $pt }} && string(c.resources.limits[k]) != '0')) ||
    (has(c.resources.requests) && c.resources.requests.exists(k, {{ $pt }} && string(c.resources.requests[k]) != '0'))))
- name: resources
  expression: >-
    size(variables.passthrough) == 0 ? [] :
    (has(variables.passthrough[0].resources.limits) ? variables.passthrough[0].resources.limits.filter(k, {{ $pt }}) : []) +
    (has(variables.passthrough[0].resources.requests) ? variables.passthrough[0].resources.requests.filter(k, {{ $pt }}) : [])
- name: runtimeClass
  expression: >-
    has(object.spec.runtimeClassName) ? object.spec.runtimeClassName : ''
- name: asking
  expression: >-
    variables.scoped.filter(c, has(c.resources) && ((has(c.resources.claims) && size(c.resources.claims) > 0) ||
    (has(c.resources.limits) && c.resources.limits.exists(k, {{ $gpu }} && string(c.resources.limits[k]) != '0')) ||
    (has(c.resources.requests) && c.resources.requests.exists(k, {{ $gpu }} && string(c.resources.requests[k]) != '0')))).map(c, c.name)
{{- end -}}

{{/* One webhook entry of the isolation webhook configurations (dict: root name ns caBundle path). */}}
{{- define "ksm.webhookCommon" -}}
{{- $root := .root -}}
{{- $w := $root.Values.isolation.webhook -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ $w.failurePolicy }}
matchPolicy: Equivalent
timeoutSeconds: {{ $w.timeoutSeconds }}
clientConfig:
  service:
    name: {{ .name }}
    namespace: {{ .ns }}
    path: {{ .path }}
    port: 443
  {{- if .caBundle }}
  caBundle: {{ .caBundle }}
  {{- end }}
rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["pods"]
    scope: Namespaced
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["UPDATE"]
    resources: ["pods/ephemeralcontainers"]
    scope: Namespaced
namespaceSelector:
  {{- include "ksm.isolationNamespaceSelector" (list $root $w.namespaceSelector) | nindent 2 }}
objectSelector:
  {{- toYaml ($w.objectSelector | default dict) | nindent 2 }}
{{- end -}}


{{/*
The log format and metrics arguments of a katamgr or sandbox-device-plugin container.
ksm.metricsArgs is called with (list $ PORT) and renders nothing with metrics off.
*/}}
{{- define "ksm.logArgs" -}}
- --log-format
- {{ .Values.logFormat | default "text" }}
{{- end -}}

{{- define "ksm.metricsOn" -}}
{{- if dig "enabled" false (.Values.metrics | default dict) }}true{{ end -}}
{{- end -}}

{{- define "ksm.metricsArgs" -}}
{{- $root := index . 0 -}}
{{- if include "ksm.metricsOn" $root }}
- --metrics-address
- 0.0.0.0:{{ index . 1 }}
{{- end }}
{{- end -}}

{{/*
The metrics port and the probes of a container serving --metrics-address (dict: root,
port, name, startupSeconds). /healthz (the loop is alive) for the startup and liveness
probes, /readyz (the work is done) for readiness. The startup probe only covers the
process coming up to the point where it serves (import, flags, the cluster client); from
then on /healthz answers ok during a long reconcile too (katamgr: up to an hour, e.g.
pulling artifacts), so liveness never kills a pod that is still pulling; readiness is
the probe that waits, and keeps a rolling update from moving on until the node is done.
*/}}
{{- define "ksm.metricsContainer" -}}
{{- if include "ksm.metricsOn" .root -}}
ports:
  - name: {{ .name }}
    containerPort: {{ .port }}
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
The RuntimeClass names kataManager.config configures (a JSON list, in config order): the
classes runtimeclasses.yaml renders, which Helm creates, updates and deletes (no identity
of the chart may write a RuntimeClass).
*/}}
{{- define "ksm.runtimeClassNames" -}}
{{- $names := list -}}
{{- range (.Values.kataManager.config.runtimeClasses | default list) -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- $names | toJson -}}
{{- end -}}

{{/*
The host the agent container (katamgr run) works on, and the same for katamgr revert in the
uninstall hook, so a revert reaches everything the agent changed: the locals both need
(JSON: vfio cdi kata signal hostProc containerdConfigDir containerdSocketDir artifactsDir
layoutDirs).
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
      "containerdConfigDir" (dir $v.containerd.configPath)
      "containerdSocketDir" (dir $v.containerd.socket)
      "artifactsDir" ($v.kataManager.config.artifactsDir | trimSuffix "/")
      "layoutDirs" $layoutDirs) -}}
{{- end -}}

{{/* The volumeMounts of the katamgr container (agent and uninstall revert). */}}
{{- define "ksm.agentMounts" -}}
{{- $h := include "ksm.agentHost" . | fromJson -}}
{{- $vfio := $h.vfio -}}
{{- $cdi := $h.cdi -}}
{{- $kata := $h.kata -}}
{{- $hostProc := $h.hostProc -}}
{{- $containerdConfigDir := $h.containerdConfigDir -}}
{{- $containerdSocketDir := $h.containerdSocketDir -}}
{{- $artifactsDir := $h.artifactsDir -}}
{{- $layoutDirs := $h.layoutDirs -}}
- name: config
  mountPath: /etc/kata-sandbox-manager
  readOnly: true
- name: validations
  mountPath: {{ include "ksm.inHost" "/run/nvidia/validations" }}
- name: state
  mountPath: {{ include "ksm.inHost" "/var/lib/kata-sandbox-manager" }}
- name: sysfs
  mountPath: {{ include "ksm.inHost" "/sys" }}
  readOnly: {{ not $vfio }}
{{- if $hostProc }}
- name: proc
  mountPath: {{ include "ksm.inHost" "/proc" }}
  readOnly: true
{{- end }}
{{- if or $vfio $cdi }}
- name: dev-vfio
  mountPath: {{ include "ksm.inHost" "/dev/vfio" }}
  readOnly: true
{{- end }}
{{- if $vfio }}
- name: lib-modules
  mountPath: {{ include "ksm.inHost" "/lib/modules" }}
  readOnly: true
# A workload switch keeps the GPUs the kubelet gave pods (its PodResources API).
- name: pod-resources
  mountPath: {{ include "ksm.inHost" "/var/lib/kubelet/pod-resources" }}
  readOnly: true
{{- end }}
# The node's Kata (gpunode.policy.katadetect): containerd's config and kata-deploy's install,
# where katamgr writes its GPU drop-in beside kata-deploy's config; read-only without Kata.
- name: containerd-config
  mountPath: {{ include "ksm.inHost" $containerdConfigDir }}
  {{- if not $kata }}
  readOnly: true
  {{- end }}
- name: kata-deploy
  mountPath: {{ include "ksm.inHost" "/opt/kata" }}
  {{- if not $kata }}
  readOnly: true
  {{- end }}
{{- if $kata }}
- name: containerd-socket
  mountPath: {{ include "ksm.inHost" $containerdSocketDir }}
- name: artifacts
  mountPath: {{ include "ksm.inHost" $artifactsDir }}
{{- range $i, $dir := $layoutDirs }}
- name: oci-layout-{{ $i }}
  mountPath: {{ include "ksm.inHost" $dir }}
  readOnly: true
{{- end }}
{{- end }}
{{- if $cdi }}
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

{{/* The device plugin's and the DRA driver's view of the node's Kata: read-only, with the
config the agent reads (--containerd-config), so that all three decide by one release. */}}
{{- define "ksm.nodeKataMounts" -}}
- name: containerd-config
  mountPath: {{ include "ksm.inHost" (dir .Values.containerd.configPath) }}
  readOnly: true
- name: kata-deploy
  mountPath: {{ include "ksm.inHost" "/opt/kata" }}
  readOnly: true
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

{{/* The kataManager config file katamgr reads (configmap.yaml, and the uninstall hook's copy). */}}
{{- define "ksm.kataManagerConfig" -}}
{{- $kata := .Values.kataManager.config }}
{{- /* The kataManager config of the GPU Operator, plus how to reach containerd. */}}
{{- /* Kata's cold-plug reads the claims too when the DRA driver serves the devices. */}}
{{- $sources := list "device-plugin" }}
{{- if (.Values.dra | default dict).enabled }}
{{- $sources = append $sources "dra" }}
{{- end }}
{{- $config := dict
      "artifactsDir" $kata.artifactsDir
      "runtimeClasses" $kata.runtimeClasses
      "containerd" .Values.containerd
      "podResourceDeviceSources" $sources }}
{{- with $kata.runtimeClassOverhead }}
{{- $_ := set $config "runtimeClassOverhead" . }}
{{- end }}
{{- with $kata.insecureRegistries }}
{{- $_ := set $config "insecureRegistries" . }}
{{- end }}
{{- /* kataDeploy: auto (the default, left out), true or false; "with" would drop false. */}}
{{- if and (hasKey $kata "kataDeploy") (not (kindIs "invalid" $kata.kataDeploy)) }}
{{- $_ := set $config "kataDeploy" $kata.kataDeploy }}
{{- end }}
{{- toYaml $config }}
{{- end -}}

{{/* The annotations of every uninstall hook object; call with its hook weight. */}}
{{- define "ksm.revertHook" -}}
helm.sh/hook: post-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/*
The runtime classes kataManager.config marks confidential (confidential: true), besides those
named *-snp or *-tdx, which are confidential by name: as a JSON list.
*/}}
{{- define "ksm.confidentialClasses" -}}
{{- $out := list -}}
{{- range (.Values.kataManager.config.runtimeClasses | default list) -}}
{{- if .confidential }}{{ $out = append $out .name }}{{ end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
