"""Exit codes of `kubeinfer serve` with a meaning the operator reads from a pod's last termination.

Torch-free, so the operator can import it.
"""

import os

TERMINATION_LOG = "/dev/termination-log"   # terminationMessagePath's default
# A runner without per-container mounts (the local cluster's pod runner) names the file instead.
TERMINATION_LOG_ENV = "KUBEINFER_TERMINATION_LOG"

# sysexits.h's EX_CONFIG: the requested device does not exist in this container, so restarting
# the same pod cannot help; the operator reports it as DeviceUnavailable instead of a bare crash loop.
DEVICE_UNAVAILABLE = 78

# Model sources (`kubeinfer fetch`, `kubeinfer serve --model hf://... | s3://...`), sysexits.h codes:
# the operator turns a pod's last exit code into a condition reason without parsing its log.
MODEL_DATA_CORRUPT = 65      # EX_DATAERR: a downloaded file failed its size or checksum check
MODEL_NOT_FOUND = 66         # EX_NOINPUT: unknown repo, revision, bucket or prefix, or no weights there
MODEL_SOURCE_UNREACHABLE = 69  # EX_UNAVAILABLE: the hub or the bucket endpoint did not answer
MODEL_CACHE_FULL = 73        # EX_CANTCREAT: the cache volume has no room for the model
MODEL_ACCESS_DENIED = 77     # EX_NOPERM: missing or refused credentials (HF_TOKEN, AWS keys)

REASONS = {
    DEVICE_UNAVAILABLE: "DeviceUnavailable",
    MODEL_DATA_CORRUPT: "ModelDataCorrupt",
    MODEL_NOT_FOUND: "ModelNotFound",
    MODEL_SOURCE_UNREACHABLE: "ModelSourceUnreachable",
    MODEL_CACHE_FULL: "ModelCacheFull",
    MODEL_ACCESS_DENIED: "ModelAccessDenied",
}


def write_termination_message(message: str) -> None:
    """What Kubernetes puts in the container's last state (terminationMessagePath's default)."""
    path = os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG
    if os.path.exists(path):  # only inside a container, where the kubelet (or the runner) made it
        with open(path, "w") as f:
            f.write(message)
