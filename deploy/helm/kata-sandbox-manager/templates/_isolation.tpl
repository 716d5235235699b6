{{/*
The two isolation layers (isolation-webhook.yaml, isolation-policy.yaml): what each looks
at (the pod admission requests, the namespace and object selectors), the CEL both policies
share (the GPU resources, the Kata handlers, the containers asking for a GPU), and one
webhook entry.
*/}}

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
pods/ephemeralcontainers subresource (kubectl debug). With "updates" (the policy, the
validating webhook) a plain Pod UPDATE too, for the CDI annotations it adds or changes (the
kubelet builds each new sandbox from the pod's annotations of the time); the mutating
webhook never sees one (a container's env cannot change after create).
Call with (dict "key" KEY "scope" SCOPE "updates" BOOL): the policy's resourceRules (no
scope), the webhooks' rules (scope Namespaced).
*/}}
{{- define "ksm.podAdmissionRules" -}}
{{ .key }}:
{{- range $operation, $resource := dict "CREATE" "pods" "UPDATE" "pods/ephemeralcontainers" }}
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: [{{ $operation | quote }}]
    resources: [{{ $resource | quote }}]
    {{- with $.scope }}
    scope: {{ . }}
    {{- end }}
{{- end }}
{{- if .updates }}
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["UPDATE"]
    resources: ["pods"]
    {{- with $.scope }}
    scope: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{/*
The node's GPU control points, as a CEL list (katamgr/admission/hostpaths.py
control_points, in the same order): a hostPath at, under or above one is refused by both
layers. The kubelet's dirs below another root dir (hostPaths.kubeletRootDir) come last.
*/}}
{{- define "ksm.gpuControlPoints" -}}
{{- $kubelet := include "ksm.kubeletDir" . -}}
['/var/lib/kubelet/device-plugins', '/var/lib/kubelet/pod-resources', '/var/lib/kubelet/plugins',
'/var/lib/kubelet/plugins_registry', '/etc/cdi', '/var/run/cdi', '/run/cdi', '/run/containerd',
'/var/run/containerd', '/run/crio', '/var/run/crio', '/sys/bus/pci', '/sys/devices',
'/sys/kernel/iommu_groups', '/sys/class', '/sys/dev', '/sys/module', '/dev/char'
{{- if ne $kubelet "/var/lib/kubelet" }}, '{{ $kubelet }}/pod-resources', '{{ $kubelet }}/plugins',
'{{ $kubelet }}/plugins_registry'{{ end }}]
{{- end -}}

{{/*
CEL: whether a plain pod UPDATE adds or changes a cdi.k8s.io/* or nvidia.cdi.k8s.io/*
annotation: the validating webhook's matchConditions, so that the API server calls it on no
other plain update (a webhook that is down then stops none of the updates controllers make).
*/}}
{{- define "ksm.cdiAnnotationsChange" -}}
request.operation != 'UPDATE' || (has(request.subResource) && request.subResource != '') ||
(has(object.metadata.annotations) && object.metadata.annotations.exists(k,
(k.startsWith('cdi.k8s.io/') || k.startsWith('nvidia.cdi.k8s.io/')) &&
!(has(oldObject.metadata.annotations) && k in oldObject.metadata.annotations &&
oldObject.metadata.annotations[k] == object.metadata.annotations[k])))
{{- end -}}

{{/*
The exempt label is honoured only where isolation-exempt-label.yaml guards it (a
ValidatingAdmissionPolicy letting only isolation.exemptLabelWriters set or remove it): "true"
or "". Unguarded, whoever may update a namespace could take it out of both layers.
*/}}
{{- define "ksm.exemptLabelGuarded" -}}
{{- $i := .Values.isolation | default dict -}}
{{- if and (include "ksm.admissionPolicyServed" .) (or (dig "webhook" "enabled" false $i) (dig "admissionPolicy" "enabled" false $i)) }}true{{ end -}}
{{- end -}}

{{/*
The namespaces the NVIDIA GPU Operator runs in, as a JSON list: each ClusterPolicy's
status.namespace, which its controller writes (ClusterPolicy.SetStatus, with the namespace the
operator runs in), looked up at helm install and upgrade (isolation.gpuOperator.findNamespace)
where the cluster serves nvidia.com/v1 ClusterPolicy. Helm's lookup sees no cluster in helm
template or a client dry run: none then.
*/}}
{{- define "ksm.gpuOperatorNamespaces" -}}
{{- $found := list -}}
{{- $find := dig "gpuOperator" "findNamespace" true (.Values.isolation | default dict) -}}
{{- if and $find (.Capabilities.APIVersions.Has "nvidia.com/v1/ClusterPolicy") -}}
{{- range (lookup "nvidia.com/v1" "ClusterPolicy" "" "").items | default list -}}
{{- with dig "status" "namespace" "" . }}{{ $found = append $found . }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $found | uniq | toJson -}}
{{- end -}}

{{/*
Every namespace both isolation layers leave out by name, as a JSON list: the release's (the
webhook never blocks its own pods), isolation.excludedNamespaces, and the GPU Operator's found
in the cluster (ksm.gpuOperatorNamespaces).
*/}}
{{- define "ksm.excludedNamespaces" -}}
{{- $named := .Values.isolation.excludedNamespaces | default list -}}
{{- concat (list .Release.Namespace) $named (include "ksm.gpuOperatorNamespaces" . | fromJsonArray) | uniq | toJson -}}
{{- end -}}

{{/*
The pods an isolation layer looks at, as the namespaceSelector and objectSelector of a
webhook entry or an admission policy binding's matchResources (one helper: both layers
leave out the same namespaces). Call with (list $ VALUES), VALUES isolation.webhook or
isolation.admissionPolicy: its own selectors, with the release namespace and
isolation.excludedNamespaces (default kube-system) excluded by name, and, where the label is
guarded (ksm.exemptLabelGuarded), every namespace labeled
isolation.kata-sandbox-manager.io/exempt=true.
*/}}
{{- define "ksm.isolationSelectors" -}}
{{- $root := index . 0 -}}
{{- $layer := index . 1 -}}
{{- $selector := deepCopy ($layer.namespaceSelector | default dict) -}}
{{- $excluded := include "ksm.excludedNamespaces" $root | fromJsonArray -}}
{{- $exempt := dict "key" "isolation.kata-sandbox-manager.io/exempt" "operator" "NotIn" "values" (list "true") -}}
{{- $exprs := concat ($selector.matchExpressions | default list) (list (dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" $excluded)) -}}
{{- if include "ksm.exemptLabelGuarded" $root }}{{ $exprs = append $exprs $exempt }}{{ end -}}
{{- $_ := set $selector "matchExpressions" $exprs -}}
namespaceSelector:
  {{- toYaml $selector | nindent 2 }}
objectSelector:
  {{- toYaml ($layer.objectSelector | default dict) | nindent 2 }}
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
{{- $gpu := include "ksm.policyGpuKind" (list . "k") -}}
{{- $pt := printf "%s && !(k in ['nvidia.com/gpu', 'nvidia.com/gpu.shared']) && !k.startsWith('nvidia.com/mig-')" $gpu -}}
- name: ephemeral
  expression: >-
    has(request.subResource) && request.subResource == 'ephemeralcontainers'
- name: update
  expression: >-
    request.operation == 'UPDATE' && !variables.ephemeral
- name: initContainers
  expression: >-
    has(object.spec.initContainers) ? object.spec.initContainers : []
- name: ephemeralContainers
  expression: >-
    has(object.spec.ephemeralContainers) ? object.spec.ephemeralContainers : []
- name: containers
  expression: >-
    variables.ephemeral || variables.update ? [] : variables.initContainers + object.spec.containers
- name: scoped
  expression: >-
    variables.update ? [] : variables.ephemeral ? variables.ephemeralContainers :
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
{{ include "ksm.podAdmissionRules" (dict "key" "rules" "scope" "Namespaced" "updates" .updates) }}
{{- if and .updates (include "ksm.admissionPolicyServed" $root) }}
{{- /* matchConditions are GA with ValidatingAdmissionPolicy v1 (Kubernetes 1.30); before
that every plain pod UPDATE reaches the webhook, which judges it the same. */}}
matchConditions:
  - name: create-debug-or-cdi-annotation-change
    expression: >-
      {{- include "ksm.cdiAnnotationsChange" . | nindent 6 }}
{{- end }}
{{ include "ksm.isolationSelectors" (list $root $w) }}
{{- end -}}
