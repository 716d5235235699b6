{{/*
What NOTES.txt reports after an install: the references that name a placeholder host
(ksm.placeholderRefs) and the GPU Operator values accepted but not applied (ksm.ignoredValues).
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

{{/*
GPU Operator values this chart accepts but does not apply, one "path" per line, for
NOTES.txt. A key counts when set to anything but false, "", [] or {}; a key that another
block overrides for the same container counts when it differs from the value used.
*/}}
{{- define "ksm.ignoredValues" -}}
{{- $v := .Values -}}
{{- $k := index .Values "kataSandboxDevicePlugin" | default dict -}}
{{- $blocks := dict "kataManager" $v.kataManager "vfioManager" $v.vfioManager
      "sandboxDevicePlugin" $v.sandboxDevicePlugin "kataSandboxDevicePlugin" $k
      "devicePlugin" $v.devicePlugin -}}
{{- $out := list -}}
{{- $cc := index .Values "ccManager" | default dict -}}
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
{{- if and (not $v.sandboxWorkloads.enabled) (ne (toString $v.sandboxWorkloads.mode) "kata") -}}
{{- $out = append $out "sandboxWorkloads.mode" -}}
{{- end -}}
{{- /* The GPU Operator's blocks for operands this chart does not run (its driver, toolkit,
       NFD, DCGM, MIG, vGPU, ...): values.schema.json accepts them whole, and each set one is
       named once here, by its top-level key. */ -}}
{{- range $key := include "ksm.gpuOperatorOnlyKeys" . | fromJsonArray -}}
{{- if not (empty (index $v $key)) }}{{ $out = append $out $key }}{{ end -}}
{{- end -}}
{{- $out | join "\n" -}}
{{- end -}}

{{/*
The top-level keys of the GPU Operator's values.yaml (NVIDIA/gpu-operator
deployments/gpu-operator/values.yaml, v26.7.0) for what this chart does not run, as a JSON
list; values.schema.json has each as a property that takes anything
(tests/chart/test_gpu_operator_values.py holds the two lists equal).
*/}}
{{- define "ksm.gpuOperatorOnlyKeys" -}}
["platform", "nfd", "psa", "validator", "operator", "mig", "driver", "toolkit", "dcgm",
 "dcgmExporter", "gfd", "migManager", "nodeStatusExporter", "gds", "gdrcopy", "vgpuManager",
 "vgpuDeviceManager", "clusterPolicy", "gpuCluster", "draDriver", "extraObjects",
 "node-feature-discovery"]
{{- end -}}
