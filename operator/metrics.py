"""The operator's own Prometheus metrics (the engines export theirs, vLLM-named)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter("kubeinfer_operator_reconciles_total",
                     "Reconciles of an InferenceService, by trigger and result.",
                     ["trigger", "result"])
RECONCILE_SECONDS = Histogram("kubeinfer_operator_reconcile_duration_seconds",
                              "Wall time of one reconcile (apply children + write status).",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
ADAPTER_OPERATIONS = Counter("kubeinfer_operator_adapter_operations_total",
                             "LoRA adapter loads and unloads the operator asked of engines, by result "
                             "(ok, or error: the engine refused or did not answer).",
                             ["operation", "result"])
