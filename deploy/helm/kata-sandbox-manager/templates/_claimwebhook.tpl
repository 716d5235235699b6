{{/*
The webhook entry that keeps a passthrough claim Kata's when the scheduler reserves it
(dra.enabled): kube-scheduler's DRA plugin writes the allocation and adds the pod to
status.reservedFor through resourceclaims/status in PreBind, before the pod is bound, and
the kubelet prepares a claim once for all its pods, so a runc pod sharing a Kata pod's
claim by name would get its VFIO devices unasked. /validate reads each pod a write adds and
refuses it outside a Kata GPU class: the scheduler's PreBind fails, the pod stays Pending.

Fail closed whatever isolation.webhook.failurePolicy says (a status write refused while no
replica answers only delays the pod). The matchConditions send only claims holding devices
of this chart's driver: other drivers' claims never wait on the webhook. Every namespace:
the driver refuses such a claim outside Kata anyway, so no namespace gains from skipping.
Call with the dict of ksm.webhookCommon.
*/}}
{{- define "ksm.claimWebhook" -}}
{{- $root := .root -}}
{{- $w := $root.Values.isolation.webhook -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: Fail
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
  - apiGroups: ["resource.k8s.io"]
    apiVersions: ["v1"]
    operations: ["UPDATE"]
    resources: ["resourceclaims/status"]
    scope: Namespaced
matchConditions:
  - name: holds-passthrough-devices
    expression: >-
      has(object.status) && has(object.status.allocation) &&
      has(object.status.allocation.devices) && has(object.status.allocation.devices.results) &&
      object.status.allocation.devices.results.exists(r, r.driver == {{ $root.Values.dra.driverName | squote }})
{{- end -}}
