# Entry points for a fresh machine. Everything heavy is cached under ~/.cache/kubeinfer.
SHELL := /bin/bash
VENV = $(shell bash .ci/venv.sh)
PROMPT ?= Explain Kubernetes in two sentences.

.PHONY: venv generate test test-unit test-e2e image

venv:
	@bash .ci/venv.sh >/dev/null

generate: venv
	$(VENV)/bin/kubeinfer generate "$(PROMPT)"

# Three pytest processes, one after the other: tests/gpu (the kernel tests pin Triton's
# interpreter for their process, and the GPU tests need the compiler), tests/ (the unit and
# integration tiers) and e2e/ (the e2e and release tiers, e2e/tiers.py). e2e/ gets a process of its
# own so the heap that the in-process engines of tests/ leave behind is back with the machine
# before the local cluster starts its pods. Each lists its 30 slowest steps, so a CI log says where
# its time went (tests/gpu reports failures only, not its skips on a machine without a GPU); the
# last line sums the three up. make fails when any fails ("no tests ran" is
# not a failure for tests/gpu without a GPU, nor for a part that a PYTEST_ARGS filter empties).
test: venv
	@status=0; summary=""; \
	for part in "tests/gpu" "tests --ignore=tests/gpu" "e2e"; do \
	  report=$$([ "$$part" = tests/gpu ] && echo -rfE || echo -ra); \
	  $(VENV)/bin/python -m pytest -q $$report -p no:cacheprovider --durations=30 $$part $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ] && { [ "$$part" = tests/gpu ] || [ -n "$(strip $(PYTEST_ARGS))" ]; }; then rc=0; fi; \
	  [ $$rc -eq 0 ] || status=$$rc; summary="$$summary $${part%% *}: $$([ $$rc -eq 0 ] && echo passed || echo "FAILED (exit $$rc)");"; \
	done; \
	echo "make test:$$summary"; exit $$status

# The developer's inner loop: the unit tier alone (in-process, no servers, no 30-layer model).
test-unit: venv
	$(VENV)/bin/python -m pytest -q -m unit $(PYTEST_ARGS)

# The local Kubernetes cluster (e2e/): binaries built once into ~/.cache/kubeinfer/bin.
.PHONY: cluster-binaries cluster-up cluster-down cluster-status test-e2e env service-url
cluster-binaries: venv
	$(VENV)/bin/python -m e2e.localcluster.binaries
cluster-up: venv
	$(VENV)/bin/python -m e2e.localcluster up
cluster-down: venv
	$(VENV)/bin/python -m e2e.localcluster down
cluster-status: venv
	$(VENV)/bin/python -m e2e.localcluster status
# eval "$(make -s env)": kubeinfer, helm and KUBECONFIG (and a second cluster's settings) in this shell.
env: venv
	@$(VENV)/bin/python -m e2e.localcluster env
# make -s service-url SERVICE=[namespace/]name: the Service's http://127.0.0.1:<port> on this machine.
service-url: venv
	@$(VENV)/bin/python -m e2e.localcluster url $(SERVICE)
test-e2e: venv
	$(VENV)/bin/python -m pytest -q -m e2e e2e $(PYTEST_ARGS)
# Opt-in, not in `make test`: GIE's own endpoint picker (v1.5.0, a ~15 min Go build when not cached)
# and Envoy in front of an InferencePool of kubeinfer engines on the local cluster (#41).
.PHONY: test-gateway
test-gateway: venv
	$(VENV)/bin/python -m e2e.localcluster.binaries envoy gie
	KUBEINFER_GIE_E2E=1 $(VENV)/bin/python -m pytest -q -s -rfEs -p no:cacheprovider e2e/test_gie_gateway.py $(PYTEST_ARGS)

# The whole story on one machine: local cluster, Helm chart, the embedded model, a chat completion.
.PHONY: demo
demo: venv
	$(VENV)/bin/python -m e2e.demo $(DEMO_ARGS)

# The product image (Dockerfile): kubeinfer/kubeinfer:<version>, the chart's default; VARIANT=cuda
# tags <version>-cuda. Push it where your cluster pulls from (README, "On a real cluster").
IMAGE ?= kubeinfer/kubeinfer
VARIANT ?= cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TAG ?= $(VERSION)$(if $(filter cuda,$(VARIANT)),-cuda)
image:
	@if builder=$$(command -v docker || command -v podman); then \
	  set -x; "$$builder" build --build-arg VARIANT=$(VARIANT) -t $(IMAGE):$(TAG) .; \
	elif command -v buildah >/dev/null; then \
	  set -x; buildah bud --build-arg VARIANT=$(VARIANT) -t $(IMAGE):$(TAG) .; \
	else \
	  echo "make image: no container builder found: install Docker, Podman or Buildah" >&2; exit 1; \
	fi
