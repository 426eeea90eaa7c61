"""Names of the InferenceService API and of what the operator stamps on its children.

One home for the strings the CRD generator, the builders, the handlers and the Helm chart
tests share, so a rename cannot leave one of them behind.
"""

from __future__ import annotations

# the identity the router and the autoscaler read too lives in their shared leaf
from kubeinfer.server.kube.api import FIELD_MANAGER, GROUP, INSTANCE_LABEL, KIND, PLURAL, VERSION  # noqa: F401

API_VERSION = f"{GROUP}/{VERSION}"
SINGULAR = "inferenceservice"
# `isvc` belongs to KServe; ours must not collide with it on clusters that run both.
SHORT_NAMES = ("kis", "infsvc")
CATEGORIES = ("kubeinfer", "all")
CRD_NAME = f"{PLURAL}.{GROUP}"

MANAGED_BY = "kubeinfer-operator"
# Which autoscaler drives spec.replicas when the built-in one is off (KServe's autoscalerClass):
# `keda` makes the operator check that KEDA is installed and that the two do not both scale.
AUTOSCALER_CLASS_ANNOTATION = "kubeinfer.io/autoscaler-class"
KEDA_CRD = "scaledobjects.keda.sh"
# Multi-pod replicas are LeaderWorkerSet groups (sigs.k8s.io/lws): the leader serves, workers hold ranks.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_VERSION = "v0.7.0"
LWS_INSTALL = (f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
               f"{LWS_VERSION}/manifests.yaml")
GIE_VERSION = "v1.5.0"   # the Gateway API Inference Extension whose InferencePool v1 spec.inferencePool renders
GIE_INSTALL = (f"kubectl apply -f https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/"
               f"download/{GIE_VERSION}/manifests.yaml")
LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
MASTER_PORT = 29500   # the leader's rendezvous (--master-port), reached by the group's workers
WORKER_COMPONENT = "engine-worker"   # a group's worker pods: never behind the Service, the router or the autoscaler
# Room left under the 63-character DNS-1035 label limit for suffixed children (`-gateway`).
MAX_NAME_LENGTH = 50

HTTP_PORT = 8000
# The engines' admin port (LoRA load/unload, /kv/blocks, /tokenizer_info): no Service exposes it.
ADMIN_PORT = 8001
SERVICE_PORT = 80
ENGINE_CONTAINER = "engine"
MODEL_MOUNT = "/models"
MODEL_CACHE_MOUNT = "/var/cache/kubeinfer"  # the node's model cache, in the fetch and engine containers
FETCH_CONTAINER = "fetch-model"
MODEL_LABEL_PREFIX = "models.kubeinfer.io"  # node labels: which models a node's cache holds
MODEL_CACHE_KEY_ANNOTATION = "kubeinfer.io/model-cache-key"  # on warm-ahead Jobs: the node label they earn
MODEL_CACHE_NODE_ANNOTATION = "kubeinfer.io/model-cache-node"
ADAPTER_MOUNT = "/adapters"
# On engine and router pod templates: spec.tenancy's inline table (no keys), read through the downward API.
TENANTS_ANNOTATION = "kubeinfer.io/tenants"
# Pod readiness gate of LoRA-enabled engines: True once the operator has loaded the adapters.
ADAPTERS_GATE = "kubeinfer.io/adapters-loaded"
