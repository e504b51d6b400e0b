"""A head and worker nodes as separate raylets on this machine, with Serve on the head.

Worker nodes offer `fake_gpu` (a custom resource standing in for GPUs, one per tensor-parallel rank) and no
room for the ingress; the head offers `ingress`, so the ingress and Serve's HTTP proxy live on the head and
a worker node's loss costs only engine replicas (the KubeRay layout in k8s/). GCS declares a silent node
dead after 3 missed 1 s health checks (Ray's defaults, 5 x 3 s, would add 12 s to every recovery here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from _cluster import free_port, on_a_free_port

WORKER_CPUS = 1.0  # one engine replica of TP=2: 0.5 (replica) + 2 x 0.25 (ranks)
FAKE_GPUS_PER_NODE = 2
NODE_DEATH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
              "health_check_failure_threshold": 3}


@dataclass
class Nodes:
    cluster: object  # ray.cluster_utils.Cluster
    http_port: int
    metrics_port: int
    workers: list = field(default_factory=list)  # ray._private.node.Node of each worker

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_worker(self):
        node = self.cluster.add_node(num_cpus=WORKER_CPUS, resources={"fake_gpu": FAKE_GPUS_PER_NODE})
        self.workers.append(node)
        return node

    def kill_worker(self, node_id: str) -> None:
        """SIGKILL the node's raylet and processes: a machine lost, not drained."""
        (node,) = [n for n in self.workers if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)


def start_nodes(num_workers: int) -> Nodes:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster, metrics_port = on_a_free_port(lambda port: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"ingress": 1}, "include_dashboard": False, "metrics_export_port": port,
        "_system_config": {**NODE_DEATH, "metrics_report_interval_ms": 1000}}))
    http_port = free_port()
    nodes = Nodes(cluster, http_port, metrics_port)
    for _ in range(num_workers):
        nodes.add_worker()
    ray.init(address=cluster.address, logging_level="warning")
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    return nodes


def stop_nodes(nodes: Nodes) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    nodes.cluster.shutdown()


def placement() -> dict:
    """Where the live actors are: {"ingress": [node], "replicas": [node], "workers": [node],
    "groups": [(strategy, {node of each bundle})]} for the created placement groups."""
    import ray._private.state as state
    from ray.util import placement_group_table

    out: dict = {"ingress": [], "replicas": [], "workers": []}
    for a in state.actors().values():
        if a["State"] != "ALIVE":
            continue
        name, node = a["ActorClassName"], a["Address"]["NodeID"]
        if name.endswith(":OpenAIIngress"):
            out["ingress"].append(node)
        elif name.endswith(":EngineReplica"):
            out["replicas"].append(node)
        elif name == "Worker":
            out["workers"].append(node)
    out["groups"] = [(pg["strategy"], set(pg["bundles_to_node_id"].values()))
                     for pg in placement_group_table().values() if pg["state"] == "CREATED"]
    return out
