{{/*
Which parts of the chart run, decided once from the values: each define renders "true" or
"" (templates ask with `if include ...`), so the DaemonSets, the RBAC, the admission
policies and NOTES.txt agree on what runs. The GPU Operator's blocks kataSandboxDevicePlugin
and ccManager are read as (index .Values "ccManager" | default dict): a release upgraded with
--reuse-values from before they existed has none.
*/}}

{{/* katamgr's Kata job (kataManager.enabled with sandbox workloads on). */}}
{{- define "ksm.kata" -}}
{{- if and .Values.sandboxWorkloads.enabled .Values.kataManager.enabled }}true{{ end -}}
{{- end -}}

{{/* katamgr runs when it has at least one job on a vm-passthrough node. */}}
{{- define "ksm.agent" -}}
{{- $v := .Values -}}
{{- if and $v.sandboxWorkloads.enabled (or $v.kataManager.enabled $v.vfioManager.enabled $v.cdi.enabled) }}true{{ end -}}
{{- end -}}

{{/* A split node's sides (gpunode.policy.splitnode, /run/kata-sandbox-manager/split.json): the
       agent writes them as it carries the split out, both device plugins list from them
       (read-only; a split is refused with the DRA driver), the uninstall revert removes them. Wherever katamgr run acts. */}}
{{- define "ksm.splitSides" -}}
{{- if and (include "ksm.agent" .) (not .Values.kataManager.planOnly) }}true{{ end -}}
{{- end -}}

{{/* kataManager.planOnly: the agent only works out and publishes the node's plan (katamgr run
       --plan-only), on the host mounted read-only; nothing else of the sandbox agent runs. */}}
{{- define "ksm.planOnly" -}}
{{- if and (include "ksm.agent" .) .Values.kataManager.planOnly }}true{{ end -}}
{{- end -}}

{{/* Off when either sandboxDevicePlugin.enabled or the GPU Operator's kataSandboxDevicePlugin.enabled
       is false, and when the DRA driver serves the passthrough devices instead (dra.enabled). */}}
{{- define "ksm.sandboxPlugin" -}}
{{- $k := index .Values "kataSandboxDevicePlugin" | default dict -}}
{{- if and .Values.sandboxWorkloads.enabled .Values.sandboxDevicePlugin.enabled (dig "enabled" true $k) (not (include "ksm.dra" .)) }}true{{ end -}}
{{- end -}}

{{/* katamgr names the pods the kubelet refused for the plugin's devices (--rejected-pods event):
       where the offer gate runs (katamgr and the sandbox device plugin in one pod) and asked. */}}
{{- define "ksm.rejectedPods" -}}
{{- if and (include "ksm.agent" .) (include "ksm.sandboxPlugin" .) (eq (.Values.sandboxDevicePlugin.rejectedPods | default "none") "event") }}true{{ end -}}
{{- end -}}

{{/* The DRA driver (sandbox-dra-driver) in the sandbox agent pod, in place of the sandbox
       device plugin: one or the other publishes a node's passthrough devices, never both.
       (| default: a release upgraded with --reuse-values from before dra existed) */}}
{{- define "ksm.dra" -}}
{{- if and .Values.sandboxWorkloads.enabled (dig "enabled" false (.Values.dra | default dict)) }}true{{ end -}}
{{- end -}}

{{/* The sandbox-agent DaemonSet is rendered: katamgr run, the passthrough device plugin or
       the DRA driver (its ServiceAccount, RBAC and node-binding policy ask the same). */}}
{{- define "ksm.sandboxAgentPod" -}}
{{- if or (include "ksm.agent" .) (include "ksm.sandboxPlugin" .) (include "ksm.dra" .) }}true{{ end -}}
{{- end -}}

{{/*
The CC manager (ccManager.enabled with sandbox workloads on): "true" or "". Its default mode:
DEFAULT_CC_MODE from ccManager.env (NVIDIA's cc-manager reads that), else defaultMode.
*/}}
{{- define "ksm.ccManager" -}}
{{- $cc := index .Values "ccManager" | default dict -}}
{{- if and .Values.sandboxWorkloads.enabled $cc.enabled }}true{{ end -}}
{{- end -}}

{{- define "ksm.ccDefaultMode" -}}
{{- $cc := index .Values "ccManager" | default dict -}}
{{- $mode := $cc.defaultMode | default "on" -}}
{{- range ($cc.env | default list) }}{{ if eq .name "DEFAULT_CC_MODE" }}{{ $mode = .value }}{{ end }}{{ end -}}
{{- $mode -}}
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

{{/* The GPU labels the agent publishes with gpuLabels.enabled (gpunode.policy.gpulabels.LABELS)
and the Kata release label (gpunode.policy.katadetect.RELEASE_LABEL), as a JSON list: the
labels the node-binding policies let the agent set and the uninstall revert take off. */}}
{{- define "ksm.gpuLabelKeys" -}}
["nvidia.com/gpu.product", "nvidia.com/gpu.family", "nvidia.com/gpu.count", "nvidia.com/gpu.memory", "nvidia.com/cc.capable", "katacontainers.io/kata-version"]
{{- end -}}

{{/* The uninstall hook runs katamgr revert (uninstall.revertNodes with katamgr on): "true" or "". */}}
{{- define "ksm.revertHookOn" -}}
{{- if and (include "ksm.agent" .) (dig "revertNodes" true (.Values.uninstall | default dict)) }}true{{ end -}}
{{- end -}}

{{/* The containers serve /metrics, /healthz and /readyz (metrics.enabled). */}}
{{- define "ksm.metricsOn" -}}
{{- if dig "enabled" false (.Values.metrics | default dict) }}true{{ end -}}
{{- end -}}
