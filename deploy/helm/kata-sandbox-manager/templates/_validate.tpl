{{/*
Values the schema accepts but the chart refuses at render time (ksm.validate, rendered by
validate.yaml), each with a message saying why and what to set instead. Checks tied to one
value stay where the value is used (ksm.image: the digest; ksm.ociLayoutDirs: the layout dirs).
*/}}

{{/*
The names NVIDIA's container device plugin advertises container GPUs under (whole GPUs,
time-sliced shares, MIG slices; a trailing * is a prefix), as a JSON list: the chart's copy
of gpunode.k8snames.NVIDIA_CONTAINER_RESOURCES (tests/chart/test_devices.py holds them equal).
Both admission layers let an ordinary container ask for these.
*/}}
{{- define "ksm.containerGpuResources" -}}
["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"]
{{- end -}}

{{/*
Refuses an alias (sandboxDevicePlugin.alias, or P_GPU_ALIAS / NVSWITCH_ALIAS in
sandboxDevicePlugin.env or kataSandboxDevicePlugin.env) that would publish passthrough
devices under a container GPU's name: a runc pod asking for nvidia.com/gpu would be handed
/dev/vfio/*. Compared without case, as katamgr and the plugin compare it
(gpunode.policy.naming.validate_alias).
*/}}
{{- define "ksm.validateAliases" -}}
{{- $k := index .Values "kataSandboxDevicePlugin" | default dict -}}
{{- $set := list (list "sandboxDevicePlugin.alias" .Values.sandboxDevicePlugin.alias) -}}
{{- range $block, $env := dict "sandboxDevicePlugin" (.Values.sandboxDevicePlugin.env | default list) "kataSandboxDevicePlugin" ($k.env | default list) -}}
{{- range $env -}}
{{- if has .name (list "P_GPU_ALIAS" "NVSWITCH_ALIAS") -}}
{{- $set = append $set (list (printf "%s.env %s" $block .name) .value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $set -}}
{{- $source := index . 0 -}}
{{- $value := toString (index . 1 | default "") -}}
{{- $name := printf "nvidia.com/%s" (lower $value) -}}
{{- range $taken := include "ksm.containerGpuResources" $ | fromJsonArray -}}
{{- if and $value (or (eq $name $taken) (and (hasSuffix "*" $taken) (hasPrefix (trimSuffix "*" $taken) $name))) -}}
{{- fail (printf "%s=%s would publish passthrough devices as nvidia.com/%s, a container GPU's name (%s, what NVIDIA's container device plugin advertises): both admission layers let an ordinary (runc) container ask for it, and the plugin would hand it the raw VFIO device; set another alias (e.g. pgpu), or none for model names" $source $value $value $taken) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Refuses an artifacts.url that is not an OCI reference, naming it and the fix, by the agent's
own rule (katamgr.artifacts.refs REFERENCE_PATTERN, copied here: tests/chart/test_artifact_refs.py
holds them equal and judges a table of references by both), so a bad reference fails the
install instead of every agent's config. A layout's dir rule (absolute, no '..') is
ksm.ociLayoutDirs'.
*/}}
{{- define "ksm.validateArtifactRefs" -}}
{{- $pattern := `^[ \t\n\r\f\v]*(?:(?:\[[0-9A-Fa-f:.]+\](?::[0-9]{1,5})?|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*:[0-9]{1,5}|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+|localhost)/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?|oci-layout://(?:/[^\x00]*@sha256:[0-9a-f]{64}|(?:/[^@\x00]*)?/(?:[^@\x00:/]*|[^@\x00/]*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})))[ \t\n\r\f\v]*$` -}}
{{- range $i, $rc := .Values.kataManager.config.runtimeClasses | default list -}}
{{- $url := dig "artifacts" "url" "" $rc | toString -}}
{{- if not (regexMatch $pattern $url) -}}
{{- $fix := "write registry-host/repository:tag or registry-host/repository@sha256:<64 hex digits> (e.g. nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:TAG), or oci-layout:///absolute/dir[:TAG] for an OCI image layout on the node" -}}
{{- $scheme := regexFind "^[A-Za-z][A-Za-z0-9+.-]*://" (trim $url) -}}
{{- if and $scheme (ne $scheme "oci-layout://") -}}
{{- $fix = printf "drop the %s scheme (a registry is named by its host alone) and %s" $scheme $fix -}}
{{- end -}}
{{- fail (printf "kataManager.config.runtimeClasses[%d].artifacts.url %q is not an OCI reference, so no agent could pull it; %s" $i $url $fix) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ksm.validate" -}}
{{- include "ksm.validateAliases" . -}}
{{- include "ksm.validateArtifactRefs" . -}}
{{- /* With sandbox workloads off no sandbox operand runs, so the mode (kubevirt in the GPU
       Operator's own defaults) chooses nothing: it is listed as ignored (ksm.ignoredValues). */ -}}
{{- if and .Values.sandboxWorkloads.enabled (eq (toString .Values.sandboxWorkloads.mode) "kubevirt") -}}
{{- fail "sandboxWorkloads.mode=kubevirt: this chart runs Kata Containers only; use the NVIDIA GPU Operator for KubeVirt, or set sandboxWorkloads.mode=kata (the default)" -}}
{{- end -}}
{{- if eq (toString .Values.sandboxWorkloads.defaultWorkload) "vm-vgpu" -}}
{{- fail "sandboxWorkloads.defaultWorkload=vm-vgpu: this chart does not run NVIDIA vGPU, so every GPU node without a workload label would get nothing from it (no GPU bound, none advertised); serve vGPU nodes with the NVIDIA GPU Operator, and set defaultWorkload to container (the default) or vm-passthrough" -}}
{{- end -}}
{{- /* A split with DRA: katamgr waits for the kubelet's device plugins only before it gives a
       GPU leaving the VM share back, not for the DRA driver's ResourceSlice to be republished,
       so a claim scheduled meanwhile could get a GPU on its way to containers (docs/devices.md). */ -}}
{{- if and (include "ksm.dra" .) (.Values.sandboxWorkloads.splits | default list) -}}
{{- fail "sandboxWorkloads.splits with dra.enabled: a split moves GPUs between VMs and containers while the DRA driver's ResourceSlice may still offer a leaving GPU to a claim (katamgr does not wait for the slice); leave sandboxWorkloads.splits empty, or set dra.enabled=false and let the device plugins serve the split nodes" -}}
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
{{- $cc := index .Values "ccManager" | default dict -}}
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
