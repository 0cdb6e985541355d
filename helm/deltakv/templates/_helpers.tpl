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

{{/*
Transfer-engine port block of one sidecar rank, as a JSON list: dict "root" $ "rank" r.
A sidecar may run two engines at once (its current one and the replacement it builds while
retiring it: issue 13's engine recycling), each listening inside this block
(sidecar/transport/ports.py), so the whole block is declared and named in the NetworkPolicy.
shm: none (pages move through /dev/shm). mori: one control port per engine, bound to the pod
IP: 2. mooncake: a handshake and a TCP data port per engine, on every interface: 4.
Rank r's block starts at enginePort + r * size; the sidecar is given its first port (--port).
*/}}
{{- define "deltakv.enginePorts" -}}
{{- $v := .root.Values }}
{{- $count := int (get (dict "shm" 0 "mooncake" 4 "mori" 2) $v.transport.backend) }}
{{- $first := add (int64 $v.sidecar.enginePort) (mul (int64 .rank) (max $count 1)) }}
{{- $ports := list }}
{{- range $i := until $count }}
{{- $ports = append $ports (add $first $i) }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/* Container port name of a rank's i-th engine port: xfer-<rank>, then xfer-<rank>-<i>. */}}
{{- define "deltakv.enginePortName" -}}
{{- if eq (int .index) 0 }}xfer-{{ .rank }}{{ else }}xfer-{{ .rank }}-{{ .index }}{{ end }}
{{- end }}

{{/* Secret with tls.crt, tls.key and ca.crt: tls.secretName, or the cert-manager Certificate's. */}}
{{- define "deltakv.tlsSecretName" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "deltakv.fullname" .)) }}
{{- end }}

{{/* Secret and key of the cluster pairing key. */}}
{{- define "deltakv.pairingSecretName" -}}
{{- .Values.pairing.existingSecret | default (printf "%s-pairing" (include "deltakv.fullname" .)) }}
{{- end }}

{{- define "deltakv.pairingSecretKey" -}}
{{- if .Values.pairing.existingSecret }}{{ .Values.pairing.existingSecretKey }}{{ else }}pairing.key{{ end }}
{{- end }}

{{/* Where every deltakv process reads the pairing key (a memory emptyDir, read-only; the
pairing-key init container copies it there from the Secret with mode 0400). */}}
{{- define "deltakv.pairingKeyFile" -}}
/etc/deltakv/pairing/pairing.key
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
{{- /* Secure by default: plain text and open pod networks only when asked for. */}}
{{- if not $v.insecure }}
{{- if not $v.tls.enabled }}
{{- fail "tls.enabled=false serves decode's DecodeService and prefill's internal PrefillService in plain text, so anyone on the pod network can call Prefill and read prompts and tokens. Keep TLS on (tls.certManager.issuerRef or tls.secretName), or set insecure=true to accept plain text (throw-away test clusters; see docs/security.md)" }}
{{- end }}
{{- if not $v.networkPolicy.enabled }}
{{- fail "networkPolicy.enabled=false lets every pod network peer reach every port, the transfer engines' included (they authenticate no writer). Keep the NetworkPolicies, or set insecure=true to accept that (see docs/security.md)" }}
{{- end }}
{{- end }}
{{- if and $v.tls.enabled (not $v.tls.secretName) (not $v.tls.certManager.issuerRef.name) }}
{{- fail "tls.enabled=true (the default) needs a certificate naming both Services, with ca.crt: set tls.certManager.issuerRef (the chart renders a cert-manager Certificate) or tls.secretName (an existing Secret with tls.crt, tls.key and ca.crt); or set tls.enabled=false and insecure=true for plain text" }}
{{- end }}
{{- if and $v.networkPolicy.enabled $v.telemetry.metrics.enabled (not $v.networkPolicy.metricsFrom) }}
{{- fail "telemetry.metrics.enabled=true with networkPolicy.enabled=true needs networkPolicy.metricsFrom: the peers allowed to scrape (e.g. your Prometheus namespace)" }}
{{- end }}
{{- if eq $v.transport.backend "mooncake" }}
{{- $block := fromJsonArray (include "deltakv.enginePorts" (dict "root" $ "rank" 0)) }}
{{- $first := int64 (first $block) }}
{{- $last := int64 (last $block) }}
{{- if or (lt $first 1024) (gt $last 65535) (and (ge $last 32768) (le $first 60999)) }}
{{- fail (printf "sidecar.enginePort=%d: with transport.backend=mooncake this sidecar's engines listen on %d-%d, and Mooncake silently picks random ports instead of any below 1024 or inside 32768-60999; choose enginePort in 1024-%d or 61000-%d" $first $first $last (sub 32768 (len $block)) (sub 65536 (len $block))) }}
{{- end }}
{{- end }}
{{- if and $v.inferencePool.enabled (eq (int64 $v.decode.httpPort) 0) }}
{{- fail "inferencePool.enabled=true needs decode.httpPort (the OpenAI API the gateway routes to); it is 0" }}
{{- end }}
{{- if and $v.inferencePool.enabled $v.inferencePool.httpRoute.enabled (not $v.inferencePool.httpRoute.gatewayName) }}
{{- fail "inferencePool.httpRoute.enabled=true needs inferencePool.httpRoute.gatewayName (the Gateway to attach to)" }}
{{- end }}
{{- if and $v.affinityRouter.enabled (eq (int64 $v.decode.httpPort) 0) }}
{{- fail "affinityRouter.enabled=true routes gRPC and HTTP; it needs decode.httpPort (0 here)" }}
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
{{- range $port := fromJsonArray (include "deltakv.enginePorts" (dict "root" $ "rank" $rank)) }}
{{- $add = append $add (list (printf "sidecar.enginePort+%d" (sub (int64 $port) (int64 $v.sidecar.enginePort))) (int64 $port)) }}
{{- end }}
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

{{/* Where the pairing-key init container alone mounts the pairing Secret. */}}
{{- define "deltakv.pairingSecretDir" -}}
/etc/deltakv/pairing-secret
{{- end }}
