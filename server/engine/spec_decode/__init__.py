"""Speculative decoding: proposers that draft tokens, and the policy that decides when to draft.

`config.py` parses `--speculative-config` (vLLM's JSON shape) and imports nothing heavy, so the
flag table and the operator can use it; the proposers (`ngram.py`, `suffix.py`,
`draft_model.py`) plug into the engine through `server/engine/proposer.py`.
"""
