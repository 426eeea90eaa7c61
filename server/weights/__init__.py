"""Where a model's files come from: source strings, the local model cache and the fetchers.

`uri` is a torch-free leaf (the operator imports it); the fetchers import their clients
(huggingface_hub, boto3) only when a source of theirs is fetched.
"""
