"""The CRI (k8s.io/cri-api runtime.v1) gRPC services in front of podgate's runtime.

`service.serve_cri` starts them; `api_pb2*` are generated from `api.proto` (see `generate`).
Nothing is imported here, so the generator runs even when the generated modules are stale.
"""
