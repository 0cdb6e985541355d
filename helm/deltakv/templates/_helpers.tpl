{{/*
Names, labels and the values the templates derive (ports, sizes, grace period). Cross-field rules
the JSON schema cannot express are checked in "deltakv.validate" and fail rendering with a message
naming the values involved.
*/}}

{{- define "deltakv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "deltakv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Object name of one pool's objects: "<fullname>-prefill" / "<fullname>-decode". */}}
{{- define "deltakv.poolName" -}}
{{- printf "%s-%s" (include "deltakv.fullname" .root | trunc 55 | trimSuffix "-") .role }}
{{- end }}

{{- define "deltakv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "deltakv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deltakv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deltakv.labels" -}}
helm.sh/chart: {{ include "deltakv.chart" . }}
{{ include "deltakv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: deltakv
{{- end }}

{{/* Selector of one pool: dict "root" $ "role" "prefill|decode". */}}
{{- define "deltakv.poolSelectorLabels" -}}
{{ include "deltakv.selectorLabels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "deltakv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "deltakv.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image variant built by `docker build --build-arg VARIANT=...` for the accelerator. */}}
{{- define "deltakv.imageVariant" -}}
{{- $variants := dict "cpu" "cpu" "nvidia" "cuda" "amd" "rocm" }}
{{- get $variants .Values.accelerator.type }}
{{- end }}

{{- define "deltakv.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion (include "deltakv.imageVariant" .)) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* DRA DeviceClass of the GPUs. */}}
{{- define "deltakv.deviceClassName" -}}
{{- $defaults := dict "nvidia" "gpu.nvidia.com" "amd" "gpu.amd.com" }}
{{- .Values.accelerator.deviceClassName | default (get $defaults .Values.accelerator.type) }}
{{- end }}

{{/* Env var restricting one sidecar process to its own GPU (rank order inside the pod). */}}
{{- define "deltakv.visibleDevicesEnv" -}}
{{- $names := dict "nvidia" "CUDA_VISIBLE_DEVICES" "amd" "HIP_VISIBLE_DEVICES" }}
{{- get $names .Values.accelerator.type }}
{{- end }}

{{/* KV bytes per token (all layers, K and V); 0 when unknown. */}}
{{- define "deltakv.kvBytesPerToken" -}}
{{- $builtin := dict "smollm2" 46080 }}
{{- $explicit := int64 .Values.model.kvBytesPerToken }}
{{- if gt $explicit 0 }}{{ $explicit }}{{ else }}{{ get $builtin .Values.model.name | default 0 | int64 }}{{ end }}
{{- end }}

{{/*
Size of a pod's memory-backed /dev/shm in MiB (rounded up): on CPU the KV pool of its sidecar
lives there (gpusPerPod (= 1) * numPages * pageSize * kvBytesPerToken), plus shm.extraBytes.
On GPUs the pools are device memory, so only the extra bytes are needed.
Argument: dict "root" $ "pool" <pool values>.
*/}}
{{- define "deltakv.shmSizeMiB" -}}
{{- $v := .root.Values }}
{{- $bytes := int64 $v.shm.extraBytes }}
{{- if eq $v.accelerator.type "cpu" }}
{{- $perPool := mul (int64 .pool.numPages) (int64 $v.kvCache.pageSize) (int64 (include "deltakv.kvBytesPerToken" .root)) }}
{{- $bytes = add $bytes (mul $perPool (int64 .pool.gpusPerPod)) }}
{{- end }}
{{- div (add $bytes 1048575) 1048576 }}
{{- end }}

{{/* Worker drain + sidecar drain + preStop sleep + 15 s, unless set explicitly. */}}
{{- define "deltakv.gracePeriodSeconds" -}}
{{- $t := .root.Values.termination }}
{{- if gt (int64 $t.gracePeriodSeconds) 0 }}
{{- int64 $t.gracePeriodSeconds }}
{{- else }}
{{- add (int64 $t.preStopSleepSeconds) (int64 .pool.drainTimeoutSeconds) (int64 .root.Values.sidecar.drainTimeoutSeconds) 15 }}
{{- end }}
{{- end }}

{{/* Port the kubelet probes on a worker: its gRPC port, or a plain-text health port with TLS. */}}
{{- define "deltakv.workerHealthPort" -}}
{{- if .root.Values.tls.enabled }}
{{- if eq .role "decode" }}{{ int64 .root.Values.tls.healthPort }}{{ else }}{{ add1 (int64 .root.Values.tls.healthPort) }}{{ end }}
{{- else }}
{{- int64 .pool.port }}
{{- end }}
{{- end }}

{{/* Decode's --prefill-target: dns:///<prefill headless Service>:port, so decode keeps one
     backend per prefill pod address (re-resolved), pins each request to one and sends its
     AbortTransfer to the same pod. */}}
{{- define "deltakv.prefillTarget" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "deltakv.poolName" (dict "root" . "role" "prefill")) .Release.Namespace .Values.clusterDomain (int64 .Values.prefill.port) }}
{{- end }}

{{/* Headless Service of the decode pods (the affinity router resolves every pod from it). */}}
{{- define "deltakv.decodeHeadless" -}}
{{- printf "%s-headless" (include "deltakv.poolName" (dict "root" . "role" "decode")) }}
{{- end }}

{{- define "deltakv.decodeTarget" -}}
{{- printf "%s.%s.svc.%s:%d" (include "deltakv.poolName" (dict "root" . "role" "decode")) .Release.Namespace .Values.clusterDomain (int64 .Values.decode.service.port) }}
{{- end }}

{{/*
Cross-field rules (the schema checks each value alone). Each failure names the values involved.
*/}}
{{- define "deltakv.validate" -}}
{{- $v := .Values }}
{{- range $role := list "prefill" "decode" }}
{{- $gpus := int64 (get $v $role).gpusPerPod }}
{{- if ne $gpus 1 }}
{{- fail (printf "%s.gpusPerPod=%d: must be 1. A deltakv worker process drives exactly one GPU through one sidecar; tensor parallelism across a pod's GPUs is not implemented. Scale with %s.replicas instead" $role $gpus $role) }}
{{- end }}
{{- end }}
{{- if and (eq $v.accelerator.type "cpu") (eq (int64 (include "deltakv.kvBytesPerToken" .)) 0) }}
{{- fail (printf "model.kvBytesPerToken is required for model %q on accelerator.type=cpu: it sizes the memory-backed /dev/shm that holds the KV pools (bytes per token over all layers, K and V)" $v.model.name) }}
{{- end }}
{{- if and (ne $v.accelerator.type "cpu") (semverCompare "<1.34.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "accelerator.type=%s shares each pod's GPUs between the worker and its sidecars through DRA (resource.k8s.io/v1), which needs Kubernetes 1.34 or newer; this cluster is %s" $v.accelerator.type .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and (eq $v.transport.backend "mori") (eq $v.accelerator.type "nvidia") }}
{{- fail "transport.backend=mori needs AMD GPUs (accelerator.type=amd) or CPU: MORI-IO is built for ROCm" }}
{{- end }}
{{- if eq $v.transport.backend "shm" }}
{{- if $v.rdma.enabled }}
{{- fail "rdma.enabled=true has no effect with transport.backend=shm (pages move through the node's shared memory); choose mooncake or mori" }}
{{- end }}
{{- if ne $v.accelerator.type "cpu" }}
{{- fail (printf "transport.backend=shm moves host-memory pools; with accelerator.type=%s choose mooncake or mori" $v.accelerator.type) }}
{{- end }}
{{- end }}
{{- if and $v.inferencePool.enabled (eq (int64 $v.decode.httpPort) 0) }}
{{- fail "inferencePool.enabled=true needs decode.httpPort (the OpenAI API the gateway routes to); it is 0" }}
{{- end }}
{{- if and $v.inferencePool.enabled $v.inferencePool.httpRoute.enabled (not $v.inferencePool.httpRoute.gatewayName) }}
{{- fail "inferencePool.httpRoute.enabled=true needs inferencePool.httpRoute.gatewayName (the Gateway to attach to)" }}
{{- end }}
{{- if and $v.affinityRouter.enabled $v.tls.enabled }}
{{- fail "affinityRouter.enabled=true with tls.enabled=true is not supported: the rendered Envoy speaks plain text to decode; terminate TLS at your own gateway" }}
{{- end }}
{{- if and $v.affinityRouter.enabled (eq (int64 $v.decode.httpPort) 0) }}
{{- fail "affinityRouter.enabled=true routes gRPC and HTTP; it needs decode.httpPort (0 here)" }}
{{- end }}
{{- if and $v.tls.enabled (not $v.tls.secretName) }}
{{- fail "tls.enabled=true needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if and $v.telemetry.otel.enabled (not $v.telemetry.otel.endpoint) }}
{{- fail "telemetry.otel.enabled=true needs telemetry.otel.endpoint (the OTLP collector URL)" }}
{{- end }}
{{- if and (gt (int64 $v.termination.gracePeriodSeconds) 0) (le (int64 $v.termination.gracePeriodSeconds) (int64 $v.sidecar.drainTimeoutSeconds)) }}
{{- fail (printf "termination.gracePeriodSeconds=%d must exceed sidecar.drainTimeoutSeconds=%d, or in-flight transfers are killed mid-write" (int64 $v.termination.gracePeriodSeconds) (int64 $v.sidecar.drainTimeoutSeconds)) }}
{{- end }}
{{- /* Every port of a pod must be distinct (with hostNetwork they also share the node). */}}
{{- range $role := list "prefill" "decode" }}
{{- $pool := get $v $role }}
{{- $ports := dict }}
{{- $add := list (list "port" (int64 $pool.port)) }}
{{- if $v.tls.enabled }}
{{- $add = append $add (list "tls.healthPort" (int64 (include "deltakv.workerHealthPort" (dict "root" $ "role" $role "pool" $pool)))) }}
{{- end }}
{{- range $rank := until (int $pool.gpusPerPod) }}
{{- $add = append $add (list (printf "sidecar.enginePort+%d" $rank) (add (int64 $v.sidecar.enginePort) $rank)) }}
{{- $add = append $add (list (printf "sidecar.healthPort+%d" $rank) (add (int64 $v.sidecar.healthPort) $rank)) }}
{{- end }}
{{- if $v.telemetry.metrics.enabled }}
{{- range $i := until (add1 (int $pool.gpusPerPod) | int) }}
{{- $add = append $add (list (printf "telemetry.metrics.port+%d" $i) (add (int64 $v.telemetry.metrics.port) $i)) }}
{{- end }}
{{- end }}
{{- range $entry := $add }}
{{- $key := toString (index $entry 1) }}
{{- if hasKey $ports $key }}
{{- fail (printf "%s pods: port %s is used twice (%s and %s); move one of them" $role $key (get $ports $key) (index $entry 0)) }}
{{- end }}
{{- if gt (int64 (index $entry 1)) 65535 }}
{{- fail (printf "%s pods: %s = %d is past 65535" $role (index $entry 0) (int64 (index $entry 1))) }}
{{- end }}
{{- $_ := set $ports $key (index $entry 0) }}
{{- end }}
{{- end }}
{{- end }}
