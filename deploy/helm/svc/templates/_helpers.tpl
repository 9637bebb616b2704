{{/*
One name for every object: kube-proxy's successor is one per cluster, and the plain
manifests of deploy/ use it too.
*/}}
{{- define "svc.name" -}}svc-agent{{- end -}}

{{- define "svc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.name | default "svc-agent" }}{{- else -}}{{ .Values.serviceAccount.name | default "default" }}{{- end -}}
{{- end -}}

{{/* The selector: stable across upgrades, so only the name. */}}
{{- define "svc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "svc.name" . }}
{{- end -}}

{{- define "svc.labels" -}}
{{ include "svc.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "svc.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* `svc-agent run`'s arguments, one per line, flag=value. */}}
{{- define "svc.args" -}}
- run
- --cgroup={{ .Values.cgroupRoot }}
- --bpffs={{ trimSuffix "/" .Values.bpffs.hostPath }}/{{ .Values.bpffs.dir }}
- --healthz-bind-address={{ include "svc.hostPort" (list .Values.healthz.bindAddress .Values.healthz.port) }}
- --metrics-bind-address={{ include "svc.hostPort" (list .Values.metrics.bindAddress .Values.metrics.port) }}
{{- if ne (toString .Values.nodePortAddresses) "primary" }}
- --nodeport-addresses={{ .Values.nodePortAddresses }}
{{- end }}
{{- if not .Values.localhostNodePorts }}
- --localhost-nodeports=false
{{- end }}
{{- with .Values.devices }}
- --devices={{ . }}
{{- end }}
{{- with .Values.packetLbDevices }}
- --packet-lb-devices={{ . }}
{{- end }}
{{- with .Values.serviceProxyName }}
- --service-proxy-name={{ . }}
{{- end }}
{{- range $flag, $value := dict "max-services" .Values.maps.maxServices "max-slots" .Values.maps.maxSlots "max-affinity-match" .Values.maps.maxAffinityMatch "max-backends" .Values.maps.maxBackends "max-affinity" .Values.maps.maxAffinity "max-sock-rev" .Values.maps.maxSockRev "max-ct" .Values.maps.maxCt "max-source-ranges" .Values.maps.maxSourceRanges "max-maglev-entries" .Values.maps.maxMaglevEntries }}
{{- if ne (toString $value) "" }}
- --{{ $flag }}={{ include "svc.int" $value }}
{{- end }}
{{- end }}
{{- /* An unquoted off in a values file is YAML's false. */}}
{{- if not (has (toString .Values.xdpMode) (list "off" "false")) }}
- --xdp-mode={{ .Values.xdpMode }}
{{- end }}
{{- if ne .Values.tcAttach "auto" }}
- --tc-attach={{ .Values.tcAttach }}
{{- end }}
{{- if ne .Values.maglev.algorithm "maglev" }}
- --lb-algorithm-external={{ .Values.maglev.algorithm }}
{{- end }}
{{- with .Values.maglev.seed }}
- --maglev-seed={{ include "svc.int" . }}
{{- end }}
{{- if not .Values.metrics.perService }}
- --per-service-metrics=false
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}


{{/*
ADDRESS:PORT, an IPv6 address in brackets: (list ADDRESS PORT).
*/}}
{{- define "svc.hostPort" -}}
{{- $addr := toString (index . 0) -}}
{{- if and (contains ":" $addr) (not (hasPrefix "[" $addr)) -}}
[{{ $addr }}]:{{ include "svc.int" (index . 1) }}
{{- else -}}
{{ $addr }}:{{ include "svc.int" (index . 1) }}
{{- end -}}
{{- end -}}

{{/*
A number as its digits: a values file's numbers are floats to Helm, which prints
1048576 as 1.048576e+06. Strings (a seed in 0x hex) are kept as written.
*/}}
{{- define "svc.int" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else if kindIs "float64" . -}}
{{- if gt . 9007199254740992.0 -}}{{ fail (printf "%v is too large for a number in a values file (a float to Helm): quote it" .) }}{{- end -}}
{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- end -}}
