"""The local Kubernetes cluster that the e2e tests, `make demo` and the cluster benchmarks run on.

etcd, the control plane and kwok as plain processes, plus a pod runner that runs `kubeinfer/`
pods as local processes on loopback IPs and a service proxy (docs/local-cluster.md). It imports
nothing else of e2e/; `python -m e2e.localcluster up|down|status|env|url` drives it, and its own
tests are in `tests/`.
"""
