{{/*
Names, labels and derived settings shared by the templates.
*/}}

{{/* The DRA driver name: a contract (the plugin's sockets, CDI names and DeviceClasses carry it), never configurable. */}}
{{- define "gpuslice.driverName" -}}gpu.gpuslice.dev{{- end }}

{{- define "gpuslice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or just the release name when it already contains the chart name. */}}
{{- define "gpuslice.fullname" -}}
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

{{- define "gpuslice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuslice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuslice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuslice.labels" -}}
helm.sh/chart: {{ include "gpuslice.chart" . }}
{{ include "gpuslice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuslice
{{- end }}

{{/* The node DaemonSet's pods: selector labels plus the component. */}}
{{- define "gpuslice.nodeSelectorLabels" -}}
{{ include "gpuslice.selectorLabels" . }}
app.kubernetes.io/component: node
{{- end }}

{{- define "gpuslice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-node" (include "gpuslice.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "registry/repository:tag" of one service; call with (dict "root" $ "svc" .Values.x). */}}
{{- define "gpuslice.image" -}}
{{- $root := .root }}
{{- $tag := .svc.image.tag | default $root.Values.image.tag | default $root.Chart.AppVersion }}
{{- if $root.Values.image.registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) .svc.image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .svc.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "gpuslice.pullPolicy" -}}
{{- .svc.image.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/* The mig-parted layouts ConfigMap the MIG manager watches. */}}
{{- define "gpuslice.migConfigMapName" -}}
{{- if .Values.migManager.layouts.create }}
{{- printf "%s-mig-parted-config" (include "gpuslice.fullname" .) | trunc 253 }}
{{- else }}
{{- required "migManager.layouts.existingConfigMap is required when migManager.layouts.create is false" .Values.migManager.layouts.existingConfigMap }}
{{- end }}
{{- end }}

{{/* The default layouts: config.yaml of files/mig-configs.yaml (a copy of
e2e/manifests/mig-configs.yaml, kept equal by e2e/tests/chart/test_chart.py). */}}
{{- define "gpuslice.migLayouts" -}}
{{- if .Values.migManager.layouts.config }}
{{- .Values.migManager.layouts.config }}
{{- else }}
{{- $manifest := .Files.Get "files/mig-configs.yaml" | fromYaml }}
{{- index $manifest.data "config.yaml" }}
{{- end }}
{{- end }}

{{/* resource.k8s.io version of the DeviceClasses. */}}
{{- define "gpuslice.deviceClassApiVersion" -}}
{{- $want := .Values.deviceClasses.apiVersion }}
{{- if ne $want "auto" }}
{{- $want }}
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1" }}
{{- "resource.k8s.io/v1" }}
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1beta2" }}
{{- "resource.k8s.io/v1beta2" }}
{{- else }}
{{- "resource.k8s.io/v1beta1" }}
{{- end }}
{{- end }}

{{/* "true" when gpu.gpuslice.dev carries extendedResourceName. */}}
{{- define "gpuslice.extendedResourceMapping" -}}
{{- $want := .Values.deviceClasses.extendedResourceMapping }}
{{- if kindIs "bool" $want }}
{{- ternary "true" "false" $want }}
{{- else }}
{{- ternary "true" "false" (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- end }}

{{/* Paths inside the node pod (every host path is mounted at the same path). */}}
{{- define "gpuslice.registrarDir" -}}{{ trimSuffix "/" .Values.hostPaths.kubeletDir }}/plugins_registry{{- end }}
{{- define "gpuslice.devicePluginsDir" -}}{{ trimSuffix "/" .Values.hostPaths.kubeletDir }}/device-plugins{{- end }}
{{- define "gpuslice.pluginsDir" -}}{{ trimSuffix "/" .Values.hostPaths.kubeletDir }}/plugins{{- end }}
{{- define "gpuslice.runDir" -}}{{ trimSuffix "/" .Values.hostPaths.runDir }}{{- end }}
{{- define "gpuslice.stateDir" -}}{{ trimSuffix "/" .Values.hostPaths.stateDir }}{{- end }}
{{- define "gpuslice.enforcerSocket" -}}{{ include "gpuslice.runDir" . }}/enforcer-$(GPUSLICE_POD_UID).sock{{- end }}
{{- define "gpuslice.enforcerHookSocket" -}}{{ include "gpuslice.runDir" . }}/enforcer.sock{{- end }}
{{- define "gpuslice.migManagerSocket" -}}{{ include "gpuslice.runDir" . }}/mig-manager-$(GPUSLICE_POD_UID).sock{{- end }}
{{- define "gpuslice.fakeNvmlDir" -}}{{ include "gpuslice.stateDir" . }}/fake-nvml{{- end }}
{{- define "gpuslice.fakeNvmlConfig" -}}{{ include "gpuslice.fakeNvmlDir" . }}/node.yaml{{- end }}
{{- define "gpuslice.hookPath" -}}{{ trimSuffix "/" .Values.enforcer.hook.hostDir }}/bin/gpuslice-enforcer-hook{{- end }}

{{/* The fake NVML config as a map, with statePath set to the shared host directory. */}}
{{- define "gpuslice.fakeConfig" -}}
{{- $cfg := .Values.nvml.fakeConfig }}
{{- if kindIs "string" $cfg }}
{{- $cfg = fromYaml $cfg }}
{{- if hasKey $cfg "Error" }}
{{- fail (printf "nvml.fakeConfig is not valid YAML: %s" (get $cfg "Error")) }}
{{- end }}
{{- else }}
{{- $cfg = deepCopy $cfg }}
{{- end }}
{{- $_ := set $cfg "statePath" "state.json" }}
{{- toYaml $cfg }}
{{- end }}

{{/* The image the node-setup init container runs: the enforcer's when it installs the hook
(the hook is copied from it), else the first service that runs. */}}
{{- define "gpuslice.setupService" -}}
{{- if .Values.enforcer.enabled }}enforcer
{{- else if .Values.kubeletPlugin.enabled }}kubeletPlugin
{{- else }}migManager
{{- end }}
{{- end }}

{{/* Environment every service shares: the node, the log level and format, NVML. */}}
{{- define "gpuslice.commonEnv" -}}
- name: GPUSLICE_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: GPUSLICE_POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: GPUSLICE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: GPUSLICE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{ include "gpuslice.nvmlEnv" . }}
{{- end }}

{{/* How a container that opens NVML reaches it: the backend, and with the real one the
host's driver root mounted at /driver-root (gpuslice.driverRootMount), where libnvidia-ml.so.1
is loaded from (--driver-root), so the NVIDIA Container Toolkit is not needed; its variables stay
for nodes where it injects the library instead. With the fake backend the kubelet plugin still
takes device nodes from the (unmounted) driver root, as before. */}}
{{- define "gpuslice.nvmlEnv" -}}
- name: GPUSLICE_NVML
  value: {{ .Values.nvml.backend | quote }}
- name: GPUSLICE_DRIVER_ROOT
  value: {{ ternary .Values.nvml.driverRoot "/driver-root" (eq .Values.nvml.backend "fake") | quote }}
{{- if eq .Values.nvml.backend "fake" }}
- name: GPUSLICE_FAKE_NVML_CONFIG
  value: {{ include "gpuslice.fakeNvmlConfig" . | quote }}
{{- else }}
- name: NVIDIA_VISIBLE_DEVICES
  value: all
- name: NVIDIA_DRIVER_CAPABILITIES
  value: compute,utility
{{- end }}
{{- end }}

{{/* The host's driver root ("/" included) read-only at /driver-root, as NVIDIA's DRA driver
mounts it; real backend only. HostToContainer: the GPU Operator's driver container mounts its
root under it after the pod starts. */}}
{{- define "gpuslice.driverRootMount" -}}
{{- if ne .Values.nvml.backend "fake" }}
- name: driver-root
  mountPath: /driver-root
  readOnly: true
  mountPropagation: HostToContainer
{{- end }}
{{- end }}

{{- define "gpuslice.driverRootVolume" -}}
{{- if ne .Values.nvml.backend "fake" }}
- name: driver-root
  hostPath:
    path: {{ .Values.nvml.driverRoot | quote }}
    type: Directory
{{- end }}
{{- end }}


{{/* Start-up, liveness and readiness probes of one container: httpGet on the service's own
health server (gpuslice_core.health, --health-addr = GPUSLICE_HEALTH_ADDR on <service>.probe.port) —
liveness /healthz, readiness and start-up /readyz; no interpreter starts in the container.
Call with <service>.probe. Start-up allows 2 minutes. */}}
{{- define "gpuslice.probes" -}}
startupProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: 2
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: 60
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}

{{/* The GPUSLICE_HEALTH_ADDR variable of a node service from <service>.probe. */}}
{{- define "gpuslice.healthEnv" -}}
- name: GPUSLICE_HEALTH_ADDR
  value: {{ printf ":%d" (int .port) | quote }}
{{- end }}

{{/* What a change of rolls the node pods: the fake node (layouts are watched live by the MIG
manager and need no restart; node-setup is gpuslice-node-setup of the images, so a new one comes
with new images, which roll the pods anyway). */}}
{{- define "gpuslice.podConfigChecksum" -}}
{{- $fake := "" }}
{{- if eq .Values.nvml.backend "fake" }}{{ $fake = include "gpuslice.fakeConfig" . }}{{ end }}
{{- $fake | sha256sum }}
{{- end }}

{{/* A controller webhook's clientConfig: the Service, or webhook.url in development;
call with (dict "c" .Values.controller "name" <service> "ns" <namespace> "path" <path>). */}}
{{- define "gpuslice.controllerClientConfig" -}}
{{- if .c.webhook.url -}}
url: {{ printf "%s/%s" (trimSuffix "/" .c.webhook.url) .path | quote }}
{{- else -}}
service:
  name: {{ .name }}
  namespace: {{ .ns }}
  path: /{{ .path }}
  port: 443
{{- end -}}
{{- end }}

{{/*
What a node identity may never change on its Node (admission-policies.yaml): everything in
metadata but the labels and annotations (each policy says which of those it may change) and the
spec. A finalizer keeps the Node from being deleted; an owner reference to an object that does
not exist makes the garbage collector delete the Node. The rest of metadata is immutable on
update or the API server's own (managedFields changes with every write, the allowed one too).
*/}}
{{- define "gpuslice.nodePinned" -}}
- expression: "object.metadata.?finalizers.orValue([]) == oldObject.metadata.?finalizers.orValue([])"
  message: {{ .who }} may not change the finalizers of its Node
- expression: >-
    object.metadata.?ownerReferences.orValue([]) ==
    oldObject.metadata.?ownerReferences.orValue([])
  message: {{ .who }} may not change the owner references of its Node
- expression: >-
    object.metadata.?generateName.orValue('') == oldObject.metadata.?generateName.orValue('')
  message: {{ .who }} may not change the generateName of its Node
- expression: "object.spec == oldObject.spec"
  message: {{ .who }} may not change the spec of its Node
{{- end }}
