"""Exit codes of `kubeinfer serve` with a meaning the operator reads from a pod's last termination.

Torch-free, so the operator can import it.
"""

# sysexits.h's EX_CONFIG: the requested device does not exist in this container, so restarting
# the same pod cannot help; the operator reports it as DeviceUnavailable instead of a bare crash loop.
DEVICE_UNAVAILABLE = 78
