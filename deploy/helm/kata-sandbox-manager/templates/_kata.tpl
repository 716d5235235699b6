{{/*
The Kata side: the kataManager config file katamgr reads (ksm.kataManagerConfig), the host
dirs of air-gapped OCI layouts it reads artifacts from (ksm.ociLayoutDirs), and the runtime
classes marked confidential (ksm.confidentialClasses).
*/}}

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
{{- /* The split per node pool: the agent applies it where a node has no split label. */}}
{{- with (.Values.sandboxWorkloads.splits | default list) }}
{{- $_ := set $config "splits" . }}
{{- end }}
{{- toYaml $config }}
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
