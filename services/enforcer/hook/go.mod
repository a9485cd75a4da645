// gpuslice-enforcer-hook: the enforcer's CDI hook as one static binary (standard library only).
// Built by hack/hook-binary.sh and by services/enforcer/Dockerfile; docs/enforcer.md.
module gpuslice.dev/enforcer/hook

go 1.22
