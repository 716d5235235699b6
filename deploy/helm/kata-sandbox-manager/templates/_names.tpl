{{/*
Names, labels and the image: what every object of the chart is called and labeled by
(ksm.fullname, ksm.labels, ksm.serviceAccountName), the one image every container runs
(ksm.image), and the annotations of the uninstall hook's objects (ksm.revertHook).
*/}}

{{/* Release-scoped base name; the release name alone when it already holds the chart name. */}}
{{- define "ksm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ksm.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ksm.labels" -}}
{{ include "ksm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
The ServiceAccount of one workload of the chart: <fullname>-<workload> (sandbox-agent,
device-plugin, webhook, revert, revert-wait). Call with (list $ WORKLOAD). fullname is at
most 40 characters, so every name stays within 63 characters.
*/}}
{{- define "ksm.serviceAccountName" -}}
{{- printf "%s-%s" (include "ksm.fullname" (index . 0)) (index . 1) -}}
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
The annotations of every uninstall hook object; call with its hook weight. Deleted once the
hook is done, whether it succeeded or failed: a failed uninstall leaves no privileged
DaemonSet, token or Node right behind (Helm 3.19+ and 4 delete the hooks that ran before the
failed one by their hook-succeeded policy, the failed one by hook-failed).
*/}}
{{- define "ksm.revertHook" -}}
helm.sh/hook: post-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded,hook-failed
{{- end -}}
