{{/*
The chart name (nameOverride wins).
*/}}
{{- define "samrollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name, the prefix of every object's name: <release>-<chart> unless the release name
already holds the chart name; fullnameOverride wins. At most 63 characters (DNS label).
*/}}
{{- define "samrollout.fullname" -}}
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

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "samrollout.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The standard labels of every object.
*/}}
{{- define "samrollout.labels" -}}
helm.sh/chart: {{ include "samrollout.chart" . }}
{{ include "samrollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: rollout-server
app.kubernetes.io/part-of: samrollout
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The labels that select the server's pods (immutable in a Deployment's selector: keep them fixed).
*/}}
{{- define "samrollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "samrollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the pods run as.
*/}}
{{- define "samrollout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "samrollout.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The name of the Secret holding the API key: apiKey.existingSecret, else the chart's own
(templates/secret.yaml: apiKey.value, or a generated key).
*/}}
{{- define "samrollout.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "samrollout.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The name of the model volume's PersistentVolumeClaim (chart-created or existing).
*/}}
{{- define "samrollout.modelClaimName" -}}
{{- default (printf "%s-models" (include "samrollout.fullname" .)) .Values.modelVolume.persistentVolumeClaim.existingClaim }}
{{- end }}

{{/*
"true" when the model volume is a claim per pod (StatefulSet volumeClaimTemplates), else "".
*/}}
{{- define "samrollout.modelClaimPerPod" -}}
{{- $pvc := .Values.modelVolume.persistentVolumeClaim }}
{{- if and (eq .Values.modelVolume.type "persistentVolumeClaim") (eq .Values.workload.kind "StatefulSet") (not $pvc.existingClaim) }}true{{- end }}
{{- end }}

{{/*
The spec of a chart-created model claim (a PVC's or a volumeClaimTemplate's).
*/}}
{{- define "samrollout.modelClaimSpec" -}}
{{- $pvc := .Values.modelVolume.persistentVolumeClaim -}}
accessModes:
{{- toYaml $pvc.accessModes | nindent 0 }}
{{- if hasKey $pvc "storageClassName" }}
storageClassName: {{ $pvc.storageClassName | quote }}
{{- end }}
resources:
  requests:
    storage: {{ $pvc.size | quote }}
{{- end }}

{{/*
The container image: repository:tag, or repository@digest.
*/}}
{{- define "samrollout.image" -}}
{{- $backend := index .Values.backends .Values.backend }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default $backend.imageTag .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Accelerators each pod requests: acceleratorCount, else server.tensorParallelSize.
*/}}
{{- define "samrollout.acceleratorCount" -}}
{{- if hasKey .Values "acceleratorCount" }}
{{- int64 .Values.acceleratorCount }}
{{- else }}
{{- int64 .Values.server.tensorParallelSize }}
{{- end }}
{{- end }}

{{/*
One server setting as an env var value (a quoted YAML scalar). Helm reads every number in
the values as a float: whole numbers are written as integers (1048576, not 1.048576e+06),
lists and maps as JSON (SAMROLLOUT_VLLM_ARGS='["--enable-sleep-mode"]'), booleans as true/false.
*/}}
{{- define "samrollout.envValue" -}}
{{- if or (kindIs "slice" .) (kindIs "map" .) }}
{{- toJson . | toJson }}
{{- else if kindIs "bool" . }}
{{- ternary "true" "false" . | quote }}
{{- else if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . | toString | quote }}
{{- else }}
{{- toString . | toJson }}
{{- end }}
{{- end }}

{{/*
Seconds Kubernetes waits after SIGTERM: terminationGracePeriodSeconds, else the server's
shutdown timeout (default 30 s) plus 30 s for the engine to stop.
*/}}
{{- define "samrollout.terminationGracePeriodSeconds" -}}
{{- if hasKey .Values "terminationGracePeriodSeconds" }}
{{- int64 .Values.terminationGracePeriodSeconds }}
{{- else }}
{{- add (ceil (index .Values.server "shutdownTimeout" | default 30)) 30 }}
{{- end }}
{{- end }}

{{/*
An IntOrString value (PodDisruptionBudget): a whole number as an integer, else a quoted string ("50%").
*/}}
{{- define "samrollout.intOrString" -}}
{{- if kindIs "string" . }}
{{- . | quote }}
{{- else }}
{{- int64 . }}
{{- end }}
{{- end }}

{{/*
A map of labels as k=v,k=v (for NOTES.txt).
*/}}
{{- define "samrollout.inlineLabels" -}}
{{- $pairs := list }}
{{- range $key, $value := . }}
{{- $pairs = append $pairs (printf "%s=%v" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
Fail the render for AReaL settings that cannot work (server.arealRoutes): AReaL sends no API key and the
chart always sets one, so AReaL needs a port of its own, which the NetworkPolicy opens to the trainer's
pods only (by their labels); and its weight loads need a root, unless told otherwise.
*/}}
{{- define "samrollout.checkArealRoutes" -}}
{{- $server := .Values.server }}
{{- $port := get $server "arealPort" }}
{{- if get $server "arealRoutes" }}
{{- if not $port }}
{{- fail "server.arealRoutes needs server.arealPort: AReaL sends no API key and the chart always sets one, so AReaL connects to a port of its own, which the chart's NetworkPolicy opens to the trainer's pods only (arealTrainer.podSelector)" }}
{{- end }}
{{- if eq (int64 $port) (int64 $server.port) }}
{{- fail (printf "server.arealPort (%d) is server.port: give AReaL's trainer a port of its own" (int64 $port)) }}
{{- end }}
{{- if not .Values.arealTrainer.podSelector }}
{{- fail "server.arealRoutes needs arealTrainer.podSelector, the labels of the trainer's pods: the NetworkPolicy admits server.arealPort (no API key there) from those pods only" }}
{{- end }}
{{- if not (or (get $server "weightsRoot") (get $server "allowAnyWeightsPath")) }}
{{- fail "server.arealRoutes needs server.weightsRoot, the directory (on a mounted volume) AReaL saves its checkpoints in: AReaL's update loads weights by path from inside it only; or set server.allowAnyWeightsPath" }}
{{- end }}
{{- else if $port }}
{{- fail "server.arealPort serves AReaL's routes: set server.arealRoutes too" }}
{{- end }}
{{- end }}

{{/*
Where the weight-staging emptyDir is mounted: the parent of server.weightStagingDir when set (the server creates
that directory in it, mode 0700: an emptyDir itself is open to every user, which the server refuses), else
weightStaging.mountPath.
*/}}
{{- define "samrollout.weightStagingMount" -}}
{{- $dir := get .Values.server "weightStagingDir" }}
{{- if $dir }}
{{- $parent := dir (trimSuffix "/" $dir) }}
{{- if eq $parent "/" }}
{{- fail (printf "server.weightStagingDir %s: with weightStaging.emptyDir the emptyDir is mounted at its parent directory, here /; give a directory inside another, e.g. /staging/weight-uploads" $dir) }}
{{- end }}
{{- $parent }}
{{- else }}
{{- trimSuffix "/" .Values.weightStaging.mountPath }}
{{- end }}
{{- end }}

{{/*
"true" when the chart makes the weight peers itself (weightFanOut, server.weightPeers unset) and
server.allowPlainHttpPeers is unset: they are plain http, so the chart allows that, else "".
*/}}
{{- define "samrollout.chartPeersInClear" -}}
{{- if and .Values.weightFanOut.enabled (not (get .Values.server "weightPeers")) (not (hasKey .Values.server "allowPlainHttpPeers")) }}true{{- end }}
{{- end }}

{{/*
Fail the render for weight peers the server would refuse at start: plain http:// peers carry the API key (which
the chart always sets) in clear, refused unless server.allowPlainHttpPeers is true.
*/}}
{{- define "samrollout.checkWeightPeers" -}}
{{- $peers := get .Values.server "weightPeers" }}
{{- $allowed := get .Values.server "allowPlainHttpPeers" }}
{{- if and $peers (contains "http://" $peers) (not $allowed) }}
{{- fail (printf "server.weightPeers %s: plain http:// peers would carry the API key in clear, which the server refuses: give https:// URLs, or set server.allowPlainHttpPeers: true where the network encrypts (a service mesh with mTLS) or nobody else reads it" $peers) }}
{{- end }}
{{- if and .Values.weightFanOut.enabled (not $peers) (hasKey .Values.server "allowPlainHttpPeers") (not $allowed) }}
{{- fail "weightFanOut makes the pods each other's peers over plain http:// (the chart has no TLS), which server.allowPlainHttpPeers: false refuses: leave it null (the chart then allows it), set weightFanOut.enabled: false, or give server.weightPeers as https:// URLs" }}
{{- end }}
{{- end }}

{{/*
The Host names the server answers to (SAMROLLOUT_ALLOWED_HOSTS, unless server.allowedHosts is set): the chart's
services, short and qualified, and (a leading dot: any name under it) their pods' names; IP literals (probes,
Prometheus by pod IP) and localhost need no entry.
*/}}
{{- define "samrollout.allowedHosts" -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list -}}
{{- range $service := list (include "samrollout.fullname" .) (printf "%s-headless" (include "samrollout.fullname" .)) -}}
{{- range $qualified := list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns) (printf "%s.%s.svc.cluster.local" $service $ns) -}}
{{- $names = append $names $qualified -}}
{{- if ne $qualified $service -}}
{{- $names = append $names (printf ".%s" $qualified) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}
