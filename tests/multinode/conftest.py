"""Multi-node service tests: a Ray cluster of several raylets on this machine (ray.cluster_utils.Cluster).
They start their own cluster, so they live apart from tests/service (whose package fixture holds a
single-node Ray for its whole package); they share its helpers (tests/service/_cluster.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
