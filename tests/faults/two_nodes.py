"""Run the app on a two-node Ray cluster on this machine, check broadcasts reach both nodes, remove one node.

Started by ``test_two_nodes.py`` in its own process (a process can join only one Ray cluster, and the test
session already runs one). Prints one JSON object with what it saw on its last line; exits non-zero on any
failed check.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # for helpers, as pytest does for the test modules
from helpers import wait_until  # noqa: E402

TOKEN = "two-nodes-token"
LABELS = ["Sports", "Technology", "Politics"]


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"two_nodes: FAILED: {message}")


def _forget_cluster(address: str) -> None:
    """Remove Ray's "current cluster" note if it names this (now stopped) cluster: a later plain
    ``ray.init()`` elsewhere on the machine would try to join it."""
    note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        if note.read_text().strip() == address:
            note.unlink()
    except OSError:
        pass


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from bench._serve import free_port, serve_actors
    from deployments.app import build_app
    from deployments.storage.redis_server import stop_orphaned_servers

    data_dir = tempfile.mkdtemp(prefix="cs-two-nodes-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {TOKEN}"}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    worker = cluster.add_node(num_cpus=1, resources={"worker": 1})
    cluster.wait_for_nodes()
    report: dict = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        # One HTTP proxy: both nodes share this machine's address and would want the same port.
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        args = {
            "data_dir": data_dir, "admin_token": TOKEN, "num_replicas": 2, "max_replicas_per_node": 1,
            "max_batch_size": 8, "num_cpus_per_replica": 1, "torch_threads": 1,
            # The manager and the ingress stay on the head node, which is not removed.
            "custom_resources": {"manager": {"head": 0.01}, "ingress": {"head": 0.01}},
        }
        serve.run(build_app(args), name="two-nodes", route_prefix="/", blocking=False)
        wait_until(lambda: len(requests.get(f"{url}/healthz", timeout=10).json().get("replicas") or {}) == 2,
                   timeout=300, what="two replicas registered", errors=(requests.RequestException,))
        replicas = serve_actors("two-nodes", "ModelReplica")
        nodes = {a["Address"]["NodeID"] for a in replicas}
        check(len(replicas) == 2 and len(nodes) == 2, f"replicas not on two nodes: {replicas}")
        report["replica_nodes"] = len(nodes)

        # Every broadcast reaches both nodes: a PUT returns once both replicas acknowledged it.
        puts = []
        for i in range(3):
            r = requests.put(f"{url}/admin/scenarios/nodes", json={"type": "labels", "labels": LABELS[: 2 + i % 2]},
                             headers=admin, timeout=120)
            check(r.status_code == 200, f"PUT {i}: {r.status_code} {r.text}")
            version = r.json()["version"]
            health = requests.get(f"{url}/healthz", timeout=30).json()
            seen = {rid: info["versions"].get("nodes") for rid, info in health["replicas"].items()}
            check(len(seen) == 2 and set(seen.values()) == {version}, f"after PUT v{version}: {seen}")
            puts.append(version)
        report["puts_acked_by_both"] = len(puts)
        labels = LABELS[: 2 + (len(puts) - 1) % 2]

        def ask(i: int) -> requests.Response:
            return requests.post(f"{url}/v1/generate", json={"scenario": "nodes", "seed": i, "max_new_tokens": 8,
                                                            "messages": [{"role": "user", "content": "Pick one."}]},
                                 timeout=180)

        def valid(r: requests.Response) -> bool:
            if r.status_code != 200:
                return False
            out = r.json()["outputs"][0]
            return out["finish_reason"] == "stop" and out["text"].strip() in labels

        with ThreadPoolExecutor(8) as pool:
            before = list(pool.map(ask, range(8)))
        check(all(valid(r) for r in before), f"before removal: {[r.text for r in before if not valid(r)]}")

        # Remove the worker node (its replica dies with it) while requests are in flight.
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, 100 + i) for i in range(8)]
            time.sleep(1.0)
            cluster.remove_node(worker)
            during = [f.result(timeout=240) for f in futures]
        with ThreadPoolExecutor(8) as pool:
            after = list(pool.map(ask, range(200, 216)))
        bad = [r.text for r in during + after if not valid(r)]
        check(not bad, f"after removing a node: {bad}")
        report["requests_after_removal"] = len(during) + len(after)

        # The manager drops the lost replica and writes go on, acknowledged by the one left.
        r = requests.put(f"{url}/admin/scenarios/nodes", json={"type": "labels", "labels": LABELS},
                         headers=admin, timeout=120)
        check(r.status_code == 200, f"PUT after removal: {r.status_code} {r.text}")
        health = requests.get(f"{url}/healthz", timeout=30).json()
        versions = [info["versions"].get("nodes") for info in health["replicas"].values()]
        check(versions == [r.json()["version"]], f"replicas after removal: {health['replicas']}")
        report["replicas_after_removal"] = len(versions)
        report["ok"] = True
    finally:
        try:
            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
        _forget_cluster(cluster.address)
        stop_orphaned_servers(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    main()
