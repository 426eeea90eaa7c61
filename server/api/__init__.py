"""`kubeinfer serve`: the OpenAI-compatible HTTP API, its metrics and its drain logic."""
