"""The autoscaler's own Prometheus series, served on the operator's metrics endpoint.

Labelled per InferenceService so a dashboard shows desired vs current replicas next to the
averaged load that drove them, and alerts can fire on scrape errors.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LABELS = ("namespace", "inferenceservice")

DESIRED_REPLICAS = Gauge("kubeinfer_autoscaler_desired_replicas",
                         "Replicas the autoscaler asked for at its last tick.", LABELS)
CURRENT_REPLICAS = Gauge("kubeinfer_autoscaler_current_replicas",
                         "spec.replicas seen at the last tick.", LABELS)
METRIC_AVERAGE = Gauge("kubeinfer_autoscaler_metric_average",
                       "The scaling metric summed over pods, averaged over the window.", LABELS)
HELD_REQUESTS = Gauge("kubeinfer_autoscaler_gateway_held_requests",
                      "Requests the scale-from-zero gateway held at the last tick.", LABELS)
SCRAPE_ERRORS = Counter("kubeinfer_autoscaler_scrape_errors",
                        "Failed /metrics scrapes of Ready engine pods.", LABELS)
SCALE_EVENTS = Counter("kubeinfer_autoscaler_scale_events",
                       "Replica changes written by the autoscaler.", (*LABELS, "direction"))
DECISION_SECONDS = Histogram("kubeinfer_autoscaler_decision_seconds",
                             "One tick: read the object, scrape the pods, decide, write.",
                             buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))


def forget(namespace: str, name: str) -> None:
    """Drop a deleted InferenceService's series so they do not linger at their last value."""
    for gauge in (DESIRED_REPLICAS, CURRENT_REPLICAS, METRIC_AVERAGE, HELD_REQUESTS,
                  SCRAPE_ERRORS):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
    for direction in ("up", "down"):
        try:
            SCALE_EVENTS.remove(namespace, name, direction)
        except KeyError:
            pass
