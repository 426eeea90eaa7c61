"""Local Kubernetes cluster for development, end-to-end tests and the demo (test infrastructure).

Nothing in the product imports this package. See `e2e/cluster.py` (``python -m e2e.cluster up``).
"""
