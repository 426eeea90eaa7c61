# Entry points for a fresh machine. Everything heavy is cached under ~/.cache/kubeinfer.
SHELL := /bin/bash
VENV = $(shell bash .ci/venv.sh)
PROMPT ?= Explain Kubernetes in two sentences.

.PHONY: venv generate test test-unit test-e2e

venv:
	@bash .ci/venv.sh >/dev/null

generate: venv
	$(VENV)/bin/kubeinfer generate "$(PROMPT)"

test: venv
	$(VENV)/bin/python -m pytest -q

test-unit: venv
	$(VENV)/bin/python -m pytest -q tests
