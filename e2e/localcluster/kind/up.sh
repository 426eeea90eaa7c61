#!/usr/bin/env bash
# Build the kubeinfer image, create the kind cluster, load the image and advertise fake GPUs.
# Needs docker and kind. Then: KUBEINFER_E2E_KUBECONFIG=$(kind get kubeconfig-path ...) — see README.
#   e2e/localcluster/kind/up.sh [cpu|cuda]
set -euo pipefail
variant="${1:-cpu}"
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
image="kubeinfer/kubeinfer:dev-${variant}"
docker build -f "$repo/e2e/localcluster/kind/Dockerfile" --build-arg "VARIANT=${variant}" -t "$image" "$repo"
kind get clusters | grep -qx kubeinfer || kind create cluster --config "$repo/e2e/localcluster/kind/kind-config.yaml"
kind load docker-image --name kubeinfer "$image"
kubeconfig="${KUBEINFER_KIND_KUBECONFIG:-$HOME/.kube/kubeinfer-kind}"
kind get kubeconfig --name kubeinfer > "$kubeconfig"
# Extended resources without a device plugin: the documented way is a node status patch, which
# the kubelet keeps. Pods then schedule by nvidia.com/gpu as on the local cluster.
for node in $(kubectl --kubeconfig "$kubeconfig" get nodes -l nvidia.com/gpu.present=true -o name); do
  kubectl --kubeconfig "$kubeconfig" patch "$node" --subresource=status --type=json \
    -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"8"}]'
done
echo "image: $image"
echo "run the e2e tests on it: KUBEINFER_E2E_KUBECONFIG=$kubeconfig make test-e2e"
