"""The router (`kubeinfer route`): picks an engine replica per request (prefix-aware, least-load,
round-robin), holds requests while none is Ready and wakes one, warms new engines. Torch-free: it
reads only the engines' wire contracts (`..api` protocol, auth and error body, `..engine.kv_events`
block hashes, `..model.tokenizer`) and the cluster through `..kube`; never the operator."""
