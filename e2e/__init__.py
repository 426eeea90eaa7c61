"""kubeinfer's end-to-end tests (`test_*.py`, the e2e and release tiers) and what they stand on.

`localcluster/` is the local Kubernetes cluster they run on (``python -m e2e.localcluster up``),
with its own tests; beside the tests are their support: `helpers.py` (the `cluster` fixture's
handle, waits), `model_stores.py` (hub- and S3-compatible servers), `gateway.py` (Envoy and GIE's
endpoint picker), `conformance.py` (the Gateway API conformance suite) and `demo.py` (`make demo`).
Nothing in the product imports this package.
"""
