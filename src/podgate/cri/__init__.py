"""The CRI (k8s.io/cri-api runtime.v1) messages and gRPC stubs, generated from `api.proto`.

Shared by the runtime's CRI server, the gateway's CRI client and the CRI proxy. Regenerate with
`python -m podgate.codegen`.
"""
