"""Queue-depth autoscaler: scrape the engines, decide replicas, write the scale subresource."""
