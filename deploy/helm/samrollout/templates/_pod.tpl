{{/*
The pod template shared by the Deployment and the StatefulSet.
*/}}
{{- define "samrollout.podTemplate" -}}
{{- include "samrollout.checkArealRoutes" . }}
{{- include "samrollout.checkWeightPeers" . }}
{{- $backend := index .Values.backends .Values.backend }}
{{- $apiKeySecret := include "samrollout.apiKeySecretName" . }}
{{- $mountPath := .Values.modelVolume.mountPath }}
{{- if $backend.resourceName }}
{{- $count := include "samrollout.acceleratorCount" . | int64 }}
{{- $tp := int64 .Values.server.tensorParallelSize }}
{{- if lt $count $tp }}
{{- fail (printf "acceleratorCount (%d) is below server.tensorParallelSize (%d): each tensor-parallel rank needs its own device" $count $tp) }}
{{- end }}
{{- end -}}
metadata:
  labels:
    {{- include "samrollout.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    kubectl.kubernetes.io/default-container: samrollout
    {{- if and (not .Values.apiKey.existingSecret) .Values.apiKey.value }}
    checksum/api-key: {{ .Values.apiKey.value | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "samrollout.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $backend.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "samrollout.terminationGracePeriodSeconds" . }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.schedulerName }}
  schedulerName: {{ . }}
  {{- end }}
  {{- with merge (deepCopy .Values.nodeSelector) $backend.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with concat $backend.tolerations .Values.tolerations }}
  tolerations:
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- $affinity := deepCopy .Values.affinity }}
  {{- if .Values.podAntiAffinity }}
  {{- $term := dict "labelSelector" (dict "matchLabels" (include "samrollout.selectorLabels" . | fromYaml)) "topologyKey" "kubernetes.io/hostname" }}
  {{- if eq .Values.podAntiAffinity "hard" }}
  {{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
  {{- else }}
  {{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
  {{- end }}
  {{- end }}
  {{- with $affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
  {{- end }}
  containers:
  - name: samrollout
    image: {{ include "samrollout.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    ports:
    - name: http
      containerPort: {{ int64 .Values.server.port }}
      protocol: TCP
    {{- with get .Values.server "arealPort" }}
    - name: areal
      containerPort: {{ int64 . }}
      protocol: TCP
    {{- end }}
    env:
    {{- range $name, $value := .Values.server }}
    {{- if not (or (kindIs "invalid" $value) (and (or (kindIs "slice" $value) (kindIs "map" $value)) (empty $value))) }}
    - name: SAMROLLOUT_{{ $name | snakecase | upper }}
      value: {{ include "samrollout.envValue" $value }}
    {{- end }}
    {{- end }}
    {{- if and .Values.weightFanOut.enabled (not (get .Values.server "weightPeers")) }}
    - name: SAMROLLOUT_WEIGHT_PEERS
      value: {{ printf "http://%s-headless.%s.svc:%d" (include "samrollout.fullname" .) .Release.Namespace (int64 .Values.server.port) | quote }}
    {{- end }}
    {{- if include "samrollout.chartPeersInClear" . }}
    # The chart's peers are plain http (the server speaks HTTP, the chart has no TLS): the key crosses the pod
    # network in clear, which the server refuses unless told (server.allowPlainHttpPeers, docs/security.md).
    - name: SAMROLLOUT_ALLOW_PLAIN_HTTP_PEERS
      value: "true"
    {{- end }}
    {{- if and .Values.weightStaging.emptyDir (not (get .Values.server "weightStagingDir")) }}
    # In the emptyDir (open to every user), a directory the server creates itself, mode 0700.
    - name: SAMROLLOUT_WEIGHT_STAGING_DIR
      value: {{ printf "%s/weight-uploads" (trimSuffix "/" .Values.weightStaging.mountPath) | quote }}
    {{- end }}
    {{- if not (get .Values.server "allowedHosts") }}
    - name: SAMROLLOUT_ALLOWED_HOSTS
      value: {{ include "samrollout.allowedHosts" . | quote }}
    {{- end }}
    - name: SAMROLLOUT_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ $apiKeySecret }}
          key: {{ .Values.apiKey.secretKey }}
    - name: SAMROLLOUT_CACHE
      value: {{ printf "%s/%s" $mountPath .Values.modelVolume.cacheSubdir | quote }}
    {{- with .Values.modelVolume.hfHomeSubdir }}
    - name: HF_HOME
      value: {{ printf "%s/%s" $mountPath . | quote }}
    {{- end }}
    {{- if and (eq .Values.backend "ascend") $backend.visibleDevices }}
    - name: ASCEND_RT_VISIBLE_DEVICES
      value: {{ $backend.visibleDevices | quote }}
    {{- else if and (eq .Values.backend "cuda") $backend.visibleDevices }}
    - name: CUDA_VISIBLE_DEVICES
      value: {{ $backend.visibleDevices | quote }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with .Values.envFrom }}
    envFrom:
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- range $kind := list "startup" "readiness" "liveness" }}
    {{- $probe := index $.Values.probes $kind }}
    {{- if $probe.enabled }}
    {{ $kind }}Probe:
      httpGet:
        path: {{ $.Values.probes.path }}
        port: http
      periodSeconds: {{ int64 $probe.periodSeconds }}
      failureThreshold: {{ int64 $probe.failureThreshold }}
      timeoutSeconds: {{ int64 $probe.timeoutSeconds }}
    {{- end }}
    {{- end }}
    {{- $resources := deepCopy .Values.resources }}
    {{- if $backend.resourceName }}
    {{- $count := include "samrollout.acceleratorCount" . | int64 }}
    {{- $_ := set $resources "limits" (merge (dict $backend.resourceName $count) ($resources.limits | default dict)) }}
    {{- $_ := set $resources "requests" (merge (dict $backend.resourceName $count) ($resources.requests | default dict)) }}
    {{- end }}
    {{- with $resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $backend.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
    {{- if .Values.shm.enabled }}
    - name: shm
      mountPath: /dev/shm
    {{- end }}
    - name: models
      mountPath: {{ $mountPath }}
      readOnly: {{ .Values.modelVolume.readOnly }}
    {{- if .Values.weightStaging.emptyDir }}
    - name: weight-staging
      mountPath: {{ include "samrollout.weightStagingMount" . | quote }}
    {{- end }}
    {{- range $backend.hostMounts }}
    - name: {{ .name }}
      mountPath: {{ .mountPath }}
      readOnly: {{ ternary (index . "readOnly") true (hasKey . "readOnly") }}
    {{- end }}
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  volumes:
  {{- if .Values.shm.enabled }}
  - name: shm
    emptyDir:
      medium: Memory
      {{- with .Values.shm.sizeLimit }}
      sizeLimit: {{ . }}
      {{- end }}
  {{- end }}
  {{- if eq .Values.modelVolume.type "persistentVolumeClaim" }}
  {{- if not (include "samrollout.modelClaimPerPod" .) }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ include "samrollout.modelClaimName" . }}
  {{- end }}
  {{- else if eq .Values.modelVolume.type "hostPath" }}
  - name: models
    hostPath:
      path: {{ .Values.modelVolume.hostPath.path }}
      type: {{ .Values.modelVolume.hostPath.type }}
  {{- else }}
  - name: models
    {{- with .Values.modelVolume.emptyDir.sizeLimit }}
    emptyDir:
      sizeLimit: {{ . }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  {{- end }}
  {{- if .Values.weightStaging.emptyDir }}
  - name: weight-staging
    {{- with .Values.weightStaging.sizeLimit }}
    emptyDir:
      sizeLimit: {{ . }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  {{- end }}
  {{- range $backend.hostMounts }}
  - name: {{ .name }}
    hostPath:
      path: {{ .hostPath }}
      {{- with index . "type" }}
      type: {{ . }}
      {{- end }}
  {{- end }}
  {{- with .Values.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
