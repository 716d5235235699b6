{{/*
The command lines of the three programs: the options katamgr, sandbox-device-plugin and
sandbox-dra-driver share (ksm.nodeArgs, from gpunode.services.options: each value passed as
values.yaml writes it), the device naming arguments (ksm.namingArgs, also the uninstall
revert's), the metrics address, and the sandbox plugin's env (ksm.pluginEnv).
*/}}

{{/*
The options katamgr, sandbox-device-plugin and sandbox-dra-driver share
(gpunode.services.options: one spelling, one default and one check for the three), each
value passed as the values file writes it: the host (hostPaths.rootFS is where containerd
sees the node's /), the node and the workload of a node without the
nvidia.com/gpu.workload.config label (the same default the container plugin's node
affinity schedules by), the log format, the device names, the device selection
(devices.include, exclude, nvswitches: auto, true or false; kataVersion, empty: found on
the node), the NVLink fabric (devices.nvlinkFabric, devices.fabricManager) and the health
policy (devices.linkPolicy). They must agree: the plugins advertise exactly the devices
katamgr binds and writes CDI specs for, and judge a GPU's link as the agent's hand-back
check between tenants does.
*/}}
{{- define "ksm.nodeArgs" -}}
{{- $devices := .Values.devices | default dict -}}
{{- $fm := $devices.fabricManager | default dict -}}
- --host-root
- /host
- --runtime-root
- {{ .Values.hostPaths.rootFS | quote }}
- --kubelet-dir
- {{ include "ksm.kubeletDir" . | quote }}
- --node-name
- $(NODE_NAME)
- --default-workload
- {{ .Values.sandboxWorkloads.defaultWorkload }}
- --log-format
- {{ .Values.logFormat | default "text" }}
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
- {{ dig "nvswitches" "auto" $devices | toString | quote }}
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
- --link-policy
- {{ $devices.linkPolicy | default "degrade" | quote }}
{{- end -}}

{{/*
The aliases NVIDIA's sandbox device plugin reads from its env, as this chart's arguments
(empty: model names). --alias: sandboxDevicePlugin.alias, else P_GPU_ALIAS from
sandboxDevicePlugin.env, else from kataSandboxDevicePlugin.env; --nvswitch-alias:
NVSWITCH_ALIAS, looked up the same way. As JSON {"P_GPU_ALIAS": .., "NVSWITCH_ALIAS": ..}.
*/}}
{{- define "ksm.aliases" -}}
{{- $k := index .Values "kataSandboxDevicePlugin" | default dict -}}
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

{{/* --metrics-address of a container serving metrics, on the port metrics.<PORT> names; call
with (list $ PORT): "agentPort" (katamgr) or "pluginPort" (the device plugins). Nothing with
metrics off. */}}
{{- define "ksm.metricsArgs" -}}
{{- $root := index . 0 -}}
{{- if include "ksm.metricsOn" $root }}
- --metrics-address
- 0.0.0.0:{{ dig (index . 1) 0 $root.Values.metrics }}
{{- end }}
{{- end -}}

{{/*
The sandbox-device-plugin container's env: sandboxDevicePlugin.env, then the entries of
kataSandboxDevicePlugin.env it does not name, less P_GPU_ALIAS and NVSWITCH_ALIAS
(arguments instead, see ksm.aliases). As a JSON list.
*/}}
{{- define "ksm.pluginEnv" -}}
{{- $k := index .Values "kataSandboxDevicePlugin" | default dict -}}
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
