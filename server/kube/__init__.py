"""The InferenceService's Kubernetes API as the operator, the autoscaler and the router all see it:
its identity, the labels that find its pods, a small REST client and the scale calls. A leaf:
it imports nothing of kubeinfer's, so every component above may lean on it."""
