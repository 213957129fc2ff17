{{/* Chart name. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name prefix of every resource (at most 45 characters so suffixes stay within 63). */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every resource. */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ include "kvpool.chart" . }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "kvpool.selectorLabels" (list . "master"). */}}
{{- define "kvpool.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvpool.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Name of the Secret that holds the cluster token. */}}
{{- define "kvpool.tokenSecretName" -}}
{{- default (printf "%s-token" (include "kvpool.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "kvpool.etcdName" -}}
{{- printf "%s-etcd" (include "kvpool.fullname" .) -}}
{{- end -}}

{{- define "kvpool.etcdHeadless" -}}
{{- printf "%s-etcd-headless" (include "kvpool.fullname" .) -}}
{{- end -}}

{{/* Address of etcd member i: include "kvpool.etcdMemberHost" (list . i). */}}
{{- define "kvpool.etcdMemberHost" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "kvpool.etcdName" $root) (int (index . 1)) (include "kvpool.etcdHeadless" $root) $root.Release.Namespace $root.Values.clusterDomain -}}
{{- end -}}

{{/* etcd endpoints as kvpool's --etcd / etcd:// take them.
In-release etcd: the one name of the headless client Service, which resolves to the ready members' IPs.
kvpool gives a single host name to gRPC's DNS resolver, which re-resolves it, so members that restart
with new pod IPs are found again (a list of names would be resolved only once). */}}
{{- define "kvpool.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s.%s.svc.%s:%d" (include "kvpool.etcdName" .) .Release.Namespace .Values.clusterDomain (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "etcd.enabled=false needs etcd.endpoints (a list of host:port)" -}}
{{- end -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Bytes in a Kubernetes quantity with a binary suffix ("4Gi" -> 4294967296). */}}
{{- define "kvpool.bytes" -}}
{{- $q := toString . -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- $unit := regexFind "(Ki|Mi|Gi|Ti)$" $q -}}
{{- if not $unit -}}
{{- fail (printf "size %q needs a binary suffix: Ki, Mi, Gi or Ti" $q) -}}
{{- end -}}
{{- mul (int64 (trimSuffix $unit $q)) (index $units $unit) -}}
{{- end -}}

{{/* The same quantity as the kvpool CLI writes it ("4Gi" -> "4GiB"). */}}
{{- define "kvpool.cliSize" -}}
{{- printf "%sB" (toString .) -}}
{{- end -}}

{{/* Store containers: a list of {name, numa, offset} (one per NUMA node, or one unbound store). */}}
{{- define "kvpool.storeInstances" -}}
{{- $out := list -}}
{{- if .Values.store.numaNodes -}}
{{- range $i, $n := .Values.store.numaNodes -}}
{{- $out = append $out (dict "name" (printf "store-numa%d" (int $n)) "numa" (int $n) "offset" $i) -}}
{{- end -}}
{{- else -}}
{{- $out = append $out (dict "name" "store" "numa" -1 "offset" 0) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Env of every kvpool container: the token file, the pool address (for kvpool-admin), cluster, logs. */}}
{{- define "kvpool.tokenEnv" -}}
- name: KVPOOL_TOKEN_FILE
  value: /etc/kvpool/token
- name: KVPOOL_MASTER
  value: {{ printf "etcd://%s" (include "kvpool.etcdEndpoints" .) | quote }}
- name: KVPOOL_CLUSTER
  value: {{ .Values.clusterName | quote }}
- name: KVPOOL_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: KVPOOL_LOG_JSON
  value: {{ .Values.logJson | quote }}
{{- end -}}

{{- define "kvpool.tokenVolumeMount" -}}
- name: token
  mountPath: /etc/kvpool
  readOnly: true
{{- end -}}

{{- define "kvpool.tokenVolume" -}}
- name: token
  secret:
    secretName: {{ include "kvpool.tokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.secretKey }}
        path: token
{{- end -}}

{{/* Pod anti-affinity spreading one component over nodes: include "kvpool.antiAffinity" (list . "master" "soft"). */}}
{{- define "kvpool.antiAffinity" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
podAntiAffinity:
{{- if eq (index . 2) "hard" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "kvpool.selectorLabels" (list $root $component) | nindent 10 }}
{{- else }}
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kvpool.selectorLabels" (list $root $component) | nindent 12 }}
{{- end }}
{{- end -}}

{{/* A byte count as a Kubernetes quantity in the largest exact binary unit (5368709120 -> 5Gi). */}}
{{- define "kvpool.quantity" -}}
{{- $b := . | int64 -}}
{{- if and (gt $b 0) (eq (mod $b 1073741824) 0) -}}{{ div $b 1073741824 }}Gi
{{- else if and (gt $b 0) (eq (mod $b 1048576) 0) -}}{{ div $b 1048576 }}Mi
{{- else if and (gt $b 0) (eq (mod $b 1024) 0) -}}{{ div $b 1024 }}Ki
{{- else -}}{{ $b }}
{{- end -}}
{{- end -}}
