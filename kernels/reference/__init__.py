"""Pure-torch references the kernels are tested against, which are also the fallback path without them."""
