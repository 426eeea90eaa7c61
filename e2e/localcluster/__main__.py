"""``python -m e2e.localcluster up|down|status|env|url`` (``make cluster-up`` and friends)."""
import sys

from .cluster import main

sys.exit(main())
