{{/*
One worker pool (prefill or decode) as a Deployment. Argument: dict "root" $ "role" "prefill|decode".

Pod layout (DESIGN §2: one worker and one sidecar per GPU, one GPU per pod):
  initContainers  sidecar-0    native sidecar (restartPolicy: Always): owns the GPU's KV pool,
                               radix index and transfer engine, and serves the worker on
                               <socketDir>/sidecar-0.sock
  containers      worker       `deltakv serve <role>`, given that socket
gpusPerPod is validated to be 1: a worker drives one GPU (tensor parallelism is not implemented).
Names and ports keep the rank suffix (sidecar-<rank>, port + rank) so they stay stable.
Shared volumes: the socket directory, /dev/shm (memory-backed; on CPU it holds the KV pool that the
worker maps zero-copy) and /tmp. The kubelet starts the worker only after the sidecar's startup
probe passed, and on termination stops the sidecar only after the worker exited, so the worker
never runs without its sidecar and in-flight transfers can drain.
*/}}
{{- define "deltakv.deployment" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $role := .role }}
{{- $pool := get $v $role }}
{{- $ctx := dict "root" $root "role" $role "pool" $pool }}
{{- $gpus := int $pool.gpusPerPod }}
{{- $socketDir := trimSuffix "/" $v.sidecar.socketDir }}
{{- $workerHealthPort := int64 (include "deltakv.workerHealthPort" $ctx) }}
{{- $onGpu := ne $v.accelerator.type "cpu" }}
{{- $poolOnGpu := eq (default "cpu" $v.accelerator.kvPoolDevice) "cuda" }}
{{- $poolKind := default "" $v.accelerator.kvPoolKind }}
{{- $metrics := $v.telemetry.metrics }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "deltakv.poolName" $ctx }}
  labels:
    {{- include "deltakv.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  replicas: {{ int $pool.replicas }}
  selector:
    matchLabels:
      {{- include "deltakv.poolSelectorLabels" $ctx | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  template:
    metadata:
      labels:
        {{- include "deltakv.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $role }}
        {{- with $pool.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $annotations := deepCopy $pool.podAnnotations }}
      {{- if $metrics.enabled }}
      {{- $_ := set $annotations "prometheus.io/scrape" "true" }}
      {{- $_ := set $annotations "prometheus.io/port" (toString (int64 $metrics.port)) }}
      {{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
      {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "deltakv.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ include "deltakv.gracePeriodSeconds" $ctx }}
      {{- if and $poolOnGpu (ne $poolKind "cuda_vmm") }}
      {{- /* Legacy CUDA IPC handles may check the exporter's PID: share the pod's namespace.
             A cuda_vmm pool travels as an fd over the pool socket and needs no such thing. */}}
      shareProcessNamespace: true
      {{- end }}
      {{- if $v.rdma.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $affinity := deepCopy $pool.affinity }}
      {{- if and (eq $v.transport.backend "shm") (not (hasKey $affinity "podAffinity")) }}
      {{- /* shm moves pages through the node's /dev/shm: every pod of the release on one node. */}}
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/name" (include "deltakv.name" $root) "app.kubernetes.io/instance" $root.Release.Name)) }}
      {{- $_ := set $affinity "podAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
      {{- end }}
      {{- if and $v.rdma.hostNetwork (not (hasKey $affinity "podAntiAffinity")) }}
      {{- /* hostNetwork: both pools' pods bind the same sidecar ports on the node, so one per node. */}}
      {{- $sel := dict "matchLabels" (dict "app.kubernetes.io/name" (include "deltakv.name" $root) "app.kubernetes.io/instance" $root.Release.Name) "matchExpressions" (list (dict "key" "app.kubernetes.io/component" "operator" "In" "values" (list "prefill" "decode"))) }}
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" $sel }}
      {{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
      {{- end }}
      {{- with $affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $onGpu }}
      resourceClaims:
        - name: gpus
          resourceClaimTemplateName: {{ include "deltakv.poolName" $ctx }}-gpus
      {{- end }}
      initContainers:
        {{- include "deltakv.pairingKeyInit" $root | nindent 8 }}
        {{- range $rank := until $gpus }}
        {{- $enginePorts := fromJsonArray (include "deltakv.enginePorts" (dict "root" $root "rank" $rank)) }}
        {{- $healthPort := add (int64 $v.sidecar.healthPort) $rank }}
        {{- $args := list "serve" "sidecar" "--role" $role "--transport" $v.transport.backend
              "--socket" (printf "%s/sidecar-%d.sock" $socketDir $rank)
              "--page-size" (toString (int64 $v.kvCache.pageSize))
              "--num-pages" (toString (int64 $pool.numPages))
              "--model" $v.model.name
              "--host" "$(POD_IP)" }}
        {{- /* The engine's listeners are fixed so the pod can declare them and policies name
               them; shm has none (pages move through /dev/shm). */}}
        {{- if $enginePorts }}
        {{- $args = concat $args (list "--port" (toString (int64 (first $enginePorts)))) }}
        {{- end }}
        {{- $args = concat $args (list "--health-port" (toString $healthPort)
              "--drain-timeout-s" (toString (int64 $v.sidecar.drainTimeoutSeconds))
              "--pairing-key-file" (include "deltakv.pairingKeyFile" $root)
              "--log-level" $v.logLevel) }}
        {{- if and (eq $role "prefill") (ne $v.decode.giveback "off") }}
        {{- /* Decode gives pages back: this pool accepts writes from decode's sidecars. */}}
        {{- $args = concat $args (list "--giveback" "on") }}
        {{- end }}
        {{- if not $onGpu }}
        {{- /* Unique per pod and rank: with transport shm every pod of the node shares /dev/shm. */}}
        {{- $args = concat $args (list "--shm-name" (printf "deltakv-$(POD_NAME)-r%d" $rank)) }}
        {{- end }}
        {{- if $poolOnGpu }}
        {{- $args = concat $args (list "--device" "cuda") }}
        {{- end }}
        {{- if $poolKind }}
        {{- $args = concat $args (list "--pool-kind" $poolKind) }}
        {{- end }}
        {{- range $key := keys $v.transport.options | sortAlpha }}
        {{- $args = concat $args (list "--transport-option" (printf "%s=%v" $key (get $v.transport.options $key))) }}
        {{- end }}
        {{- $nic := "" }}
        {{- if $v.rdma.nics }}
        {{- $nic = index $v.rdma.nics (mod $rank (len $v.rdma.nics)) }}
        {{- if eq $v.transport.backend "mooncake" }}
        {{- $args = concat $args (list "--transport-option" (printf "device_name=%s" $nic)) }}
        {{- end }}
        {{- end }}
        {{- if $metrics.enabled }}
        {{- $args = concat $args (list "--metrics-port" (toString (add (int64 $metrics.port) 1 $rank))) }}
        {{- end }}
        - name: sidecar-{{ $rank }}
          image: {{ include "deltakv.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          # Native sidecar: started before the worker, kept running, stopped after it.
          restartPolicy: Always
          command: ["deltakv"]
          args:
            {{- range $args }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "deltakv.commonEnv" (dict "root" $root "role" $role "process" "sidecar" "rank" $rank) | nindent 12 }}
            {{- if $onGpu }}
            - name: {{ include "deltakv.visibleDevicesEnv" $root }}
              value: {{ $rank | quote }}
            {{- end }}
            {{- if and $nic (eq $v.transport.backend "mori") }}
            - name: {{ $v.rdma.nicEnvName | default "MORI_RDMA_DEVICES" }}
              value: {{ $nic | quote }}
            {{- end }}
          ports:
            {{- range $i, $port := $enginePorts }}
            - name: {{ include "deltakv.enginePortName" (dict "rank" $rank "index" $i) }}
              containerPort: {{ int64 $port }}
              protocol: TCP
            {{- end }}
            - name: health-{{ $rank }}
              containerPort: {{ $healthPort }}
              protocol: TCP
            {{- if $metrics.enabled }}
            - name: metrics-{{ $rank }}
              containerPort: {{ add (int64 $metrics.port) 1 $rank }}
              protocol: TCP
            {{- end }}
          {{- include "deltakv.grpcProbes" (dict "root" $root "port" $healthPort) | nindent 10 }}
          {{- $res := deepCopy ($pool.sidecarResources | default dict) }}
            {{- if and $v.rdma.enabled $v.rdma.resources }}
            {{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) $v.rdma.resources) }}
            {{- $_ := set $res "limits" (merge (deepCopy ($res.limits | default dict)) $v.rdma.resources) }}
            {{- end }}
            {{- if $onGpu }}
            {{- $_ := set $res "claims" (list (dict "name" "gpus")) }}
            {{- end }}
          resources:
            {{- if $res }}
            {{- toYaml $res | nindent 12 }}
            {{- else }} {}
            {{- end }}
          securityContext:
            {{- $sc := deepCopy $v.securityContext }}
            {{- if and $v.rdma.enabled $v.rdma.ipcLock }}
            {{- $caps := deepCopy ($sc.capabilities | default dict) }}
            {{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            {{- include "deltakv.volumeMounts" $root | nindent 12 }}
        {{- end }}
      containers:
        {{- $wargs := list "serve" $role "--model" $v.model.name "--sidecar-socket" (printf "%s/sidecar-0.sock" $socketDir) "--sidecar-channel" $v.sidecar.channel }}
        {{- if eq $role "decode" }}
        {{- $wargs = concat $wargs (list "--prefill-target" (include "deltakv.prefillTarget" $root)) }}
        {{- end }}
        {{- $wargs = concat $wargs (list "--host" "0.0.0.0" "--port" (toString (int64 $pool.port))) }}
        {{- if and (eq $role "decode") (gt (int64 $pool.httpPort) 0) }}
        {{- $wargs = concat $wargs (list "--http-port" (toString (int64 $pool.httpPort))) }}
        {{- end }}
        {{- if eq $role "decode" }}
        {{- $wargs = concat $wargs (list "--max-batch-size" (toString (int64 $pool.maxBatchSize)) "--prefill-timeout-ms" (toString (int64 $pool.prefillTimeoutMs)) "--lease-ms" (toString (int64 $pool.leaseMs)) "--stall-timeout-s" (toString $pool.stallTimeoutSeconds) "--giveback" $v.decode.giveback) }}
        {{- else if ne $v.decode.giveback "off" }}
        {{- $wargs = concat $wargs (list "--giveback" "on") }}
        {{- end }}
        {{- $wargs = concat $wargs (list "--drain-timeout-s" (toString (int64 $pool.drainTimeoutSeconds)) "--pairing-key-file" (include "deltakv.pairingKeyFile" $root) "--log-level" $v.logLevel) }}
        {{- if $pool.torchThreads }}
        {{- $wargs = concat $wargs (list "--torch-threads" (toString (int64 $pool.torchThreads))) }}
        {{- end }}
        {{- if $poolOnGpu }}
        {{- $wargs = concat $wargs (list "--device" "cuda") }}
        {{- end }}
        {{- if $metrics.enabled }}
        {{- $wargs = concat $wargs (list "--metrics-port" (toString (int64 $metrics.port))) }}
        {{- end }}
        {{- if $v.tls.enabled }}
        {{- $wargs = concat $wargs (list "--tls-cert" "/etc/deltakv/tls/tls.crt" "--tls-key" "/etc/deltakv/tls/tls.key" "--health-port" (toString $workerHealthPort)) }}
        {{- /* --tls-ca on a server = client certificates required: always on the internal prefill
               port (only decode calls it), on decode's public port when asked. Decode verifies
               prefill against the same CA and presents the Secret's certificate to it. */}}
        {{- if or (eq $role "prefill") $v.tls.requireClientCert }}
        {{- $wargs = concat $wargs (list "--tls-ca" "/etc/deltakv/tls/ca.crt") }}
        {{- end }}
        {{- if eq $role "decode" }}
        {{- $wargs = concat $wargs (list "--prefill-tls-ca" "/etc/deltakv/tls/ca.crt") }}
        {{- end }}
        {{- end }}
        - name: worker
          image: {{ include "deltakv.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["deltakv"]
          args:
            {{- range $wargs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "deltakv.commonEnv" (dict "root" $root "role" $role "process" "worker" "rank" "all") | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ int64 $pool.port }}
              protocol: TCP
            {{- if and (eq $role "decode") (gt (int64 $pool.httpPort) 0) }}
            - name: http
              containerPort: {{ int64 $pool.httpPort }}
              protocol: TCP
            {{- end }}
            {{- if $v.tls.enabled }}
            - name: grpc-health
              containerPort: {{ $workerHealthPort }}
              protocol: TCP
            {{- end }}
            {{- if $metrics.enabled }}
            - name: metrics
              containerPort: {{ int64 $metrics.port }}
              protocol: TCP
            {{- end }}
          {{- include "deltakv.grpcProbes" (dict "root" $root "port" $workerHealthPort) | nindent 10 }}
          {{- if gt (int64 $v.termination.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              # Let Service endpoints drop this pod before SIGTERM starts the drain.
              sleep:
                seconds: {{ int64 $v.termination.preStopSleepSeconds }}
          {{- end }}
          {{- $wres := deepCopy ($pool.resources | default dict) }}
          {{- if $onGpu }}
          {{- $_ := set $wres "claims" (list (dict "name" "gpus")) }}
          {{- end }}
          resources:
            {{- if $wres }}
            {{- toYaml $wres | nindent 12 }}
            {{- else }} {}
            {{- end }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "deltakv.volumeMounts" $root | nindent 12 }}
      volumes:
        - name: sockets
          emptyDir: {}
        - name: tmp
          emptyDir: {}
        - name: dshm
          {{- if eq $v.transport.backend "shm" }}
          # The node's own /dev/shm: the shm backend maps the peer pod's pool by name.
          hostPath:
            path: /dev/shm
            type: Directory
          {{- else }}
          emptyDir:
            medium: Memory
            sizeLimit: {{ include "deltakv.shmSizeMiB" $ctx }}Mi
          {{- end }}
        {{- if $v.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ include "deltakv.tlsSecretName" $root }}
            defaultMode: 0440
        {{- end }}
        # The cluster pairing key. The kubelet adds group read to a Secret volume's files
        # whenever the pod has an fsGroup (whatever defaultMode says), so the Secret is
        # mounted only into the pairing-key init container, which copies the key into a
        # memory-backed emptyDir as a file of the pod's user, mode 0400: what every deltakv
        # process reads.
        - name: pairing-secret
          secret:
            secretName: {{ include "deltakv.pairingSecretName" $root }}
            defaultMode: 0400
            items:
              - key: {{ include "deltakv.pairingSecretKey" $root }}
                path: {{ base (include "deltakv.pairingKeyFile" $root) }}
        - name: pairing
          emptyDir:
            medium: Memory
            sizeLimit: 1Mi
{{- end }}

{{/*
The one-shot init container that puts the pairing key where the deltakv processes read it,
readable by the pod's user only (see the pairing volumes above): coreutils' install copies it
from the Secret and sets mode 0400; the file belongs to runAsUser. Runs before the sidecars.
*/}}
{{- define "deltakv.pairingKeyInit" -}}
{{- $v := .Values -}}
{{- $keyFile := include "deltakv.pairingKeyFile" . -}}
- name: pairing-key
  image: {{ include "deltakv.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["install"]
  args:
    - "-m"
    - "0400"
    - {{ printf "%s/%s" (include "deltakv.pairingSecretDir" .) (base $keyFile) | quote }}
    - {{ $keyFile | quote }}
  resources:
    requests:
      cpu: 10m
      memory: 16Mi
    limits:
      memory: 64Mi
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - name: pairing-secret
      mountPath: {{ include "deltakv.pairingSecretDir" . }}
      readOnly: true
    - name: pairing
      mountPath: {{ dir $keyFile }}
{{- end }}

{{/* Env shared by every deltakv process: dict "root" "role" "process" (worker|sidecar) "rank". */}}
{{- define "deltakv.commonEnv" -}}
{{- $v := .root.Values -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
# The root filesystem is read-only; caches (transformers, torch) go to the /tmp emptyDir.
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- if $v.telemetry.otel.enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "deltakv-%s-%s" .role .process | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $v.telemetry.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $v.telemetry.otel.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $v.telemetry.otel.sampler | quote }}
{{- with $v.telemetry.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" (printf "deltakv.role=%s" .role) (printf "deltakv.rank=%v" .rank) }}
{{- range $key := keys $v.telemetry.otel.resourceAttributes | sortAlpha }}
{{- $attrs = append $attrs (printf "%s=%v" $key (get $v.telemetry.otel.resourceAttributes $key)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end }}

{{- define "deltakv.volumeMounts" -}}
- name: sockets
  mountPath: {{ trimSuffix "/" .Values.sidecar.socketDir }}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/deltakv/tls
  readOnly: true
{{- end }}
- name: pairing
  mountPath: {{ dir (include "deltakv.pairingKeyFile" .) }}
  readOnly: true
{{- end }}

{{/* Native gRPC probes (grpc.health.v1, overall server status) on the pod IP: dict "root" "port". */}}
{{- define "deltakv.grpcProbes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ int64 $p.startup.periodSeconds }}
  failureThreshold: {{ int64 $p.startup.failureThreshold }}
  timeoutSeconds: {{ int64 $p.startup.timeoutSeconds }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ int64 $p.readiness.periodSeconds }}
  failureThreshold: {{ int64 $p.readiness.failureThreshold }}
  timeoutSeconds: {{ int64 $p.readiness.timeoutSeconds }}
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ int64 $p.liveness.periodSeconds }}
  failureThreshold: {{ int64 $p.liveness.failureThreshold }}
  timeoutSeconds: {{ int64 $p.liveness.timeoutSeconds }}
{{- end }}
