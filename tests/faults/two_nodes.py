"""Run the app on a two-node Ray cluster on this machine, check broadcasts reach both nodes, that the replica on
the node without the manager applies a catalog PATCH's delta to its own tables (``replica_table_delta: auto``) and
answers from the new version, then remove that node in the middle of a PATCH and of requests.

Started by ``test_two_nodes.py`` in its own process (a process can join only one Ray cluster, and the test
session already runs one). Prints one JSON object with what it saw on its last line; exits non-zero on any
failed check.
"""

from __future__ import annotations

import json
import os
import random
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
CATALOG_ITEMS = 50_000  # 4-token items: ~190,000 states, enough for a 200-item PATCH to be a table delta


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


class Catalog:
    """A catalog scenario's items as the client knows them, its NDJSON upload and its PATCH bodies."""

    def __init__(self, tokenizer, n: int, seed: int = 7):
        from deployments.examples import chat_root_token_id

        self.rng = random.Random(seed)
        self.head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
                     "max_new_tokens": 8}
        self.items: set[tuple[int, ...]] = set()
        while len(self.items) < n:
            self.items.add(self._new())

    def _new(self) -> tuple[int, ...]:
        return tuple(self.rng.randrange(1000, 40000) for _ in range(4))

    def ndjson(self) -> bytes:
        lines = [json.dumps(self.head)] + [json.dumps(list(i)) for i in sorted(self.items)]
        return ("\n".join(lines) + "\n").encode()

    def delta(self, k: int) -> tuple[dict, set, set]:
        """A PATCH body adding ``k`` new items and removing ``k``, and the client's items before and after it."""
        remove = self.rng.sample(sorted(self.items), k)
        add: set[tuple[int, ...]] = set()
        while len(add) < k:
            item = self._new()
            if item not in self.items:
                add.add(item)
        after = (self.items - set(remove)) | add
        return {"add": [list(i) for i in add], "remove": [list(i) for i in remove]}, set(self.items), after


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from bench._serve import serve_actors
    from helpers import free_port
    from deployments.app import build_app
    from deployments.model_loader import load_tokenizer
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

        # A catalog, then a PATCH: the replica on the worker node (the tables are not in its node's object store)
        # applies the delta to its own tables, the one beside the manager fetches them; both answer from it.
        tokenizer = load_tokenizer()
        eos = tokenizer.eos_token_id
        cat = Catalog(tokenizer, CATALOG_ITEMS)
        ndjson = {**admin, "Content-Type": "application/x-ndjson"}
        r = requests.put(f"{url}/admin/scenarios/items", data=cat.ndjson(), headers=ndjson, timeout=240)
        check(r.status_code == 200 and r.json()["items"] == CATALOG_ITEMS, f"catalog PUT: {r.status_code} {r.text}")

        def ask_item(i: int) -> requests.Response:
            return requests.post(f"{url}/v1/generate", json={"scenario": "items", "seed": i, "n": 4,
                                                            "temperature": 2.0, "max_new_tokens": 8,
                                                            "messages": [{"role": "user", "content": "An item."}]},
                                 timeout=180)

        def check_items(responses: list[requests.Response], version: int, items: set, what: str) -> None:
            for r in responses:
                check(r.status_code == 200, f"{what}: {r.status_code} {r.text}")
                body = r.json()
                check(body["version"] == version, f"{what}: answered from v{body['version']}, not v{version}")
                for out in body["outputs"]:
                    ids = list(out["token_ids"])
                    check(out["finish_reason"] == "stop" and ids[-1:] == [eos] and tuple(ids[:-1]) in items,
                          f"{what}: {ids} is not an item of v{version}")

        body, before_items, after_items = cat.delta(100)
        r = requests.patch(f"{url}/admin/scenarios/items", json=body, headers=admin, timeout=240)
        check(r.status_code == 200, f"PATCH: {r.status_code} {r.text}")
        patched = r.json()["version"]
        cat.items = after_items
        health = requests.get(f"{url}/healthz", timeout=30).json()["replicas"]
        check({info["versions"].get("items") for info in health.values()} == {patched}, f"after PATCH: {health}")
        applied = sorted(info["table_deltas"] for info in health.values())
        check(applied == [0, 1], f"table deltas applied per replica (one on each node expected [0, 1]): {applied}")
        report["delta_applied_on_the_other_node"] = True
        with ThreadPoolExecutor(4) as pool:
            check_items(list(pool.map(ask_item, range(8))), patched, cat.items, "after PATCH")

        # Remove the worker node (its replica dies with it) while requests and a PATCH are in flight: the PATCH is
        # acknowledged by the replica left, which serves it; the answers during the removal are each valid.
        body, _, after_items = cat.delta(100)
        with ThreadPoolExecutor(9) as pool:
            futures = [pool.submit(ask, 100 + i) for i in range(8)]
            patching = pool.submit(requests.patch, f"{url}/admin/scenarios/items", json=body, headers=admin,
                                   timeout=240)
            time.sleep(0.05)
            cluster.remove_node(worker)
            during = [f.result(timeout=240) for f in futures]
            r = patching.result(timeout=240)
        check(r.status_code == 200, f"PATCH during the removal: {r.status_code} {r.text}")
        acked = r.json()["version"]
        check(acked == patched + 1, f"PATCH during the removal: version {acked}, expected {patched + 1}")
        cat.items = after_items
        stored = requests.get(f"{url}/admin/scenarios/items", headers=admin, timeout=30)
        check(stored.headers.get("etag") == f'"{acked}"', f"stored after the removal: {stored.headers}")
        check_items([ask_item(300 + i) for i in range(4)], acked, cat.items, "after the removal")
        report["patch_during_removal_served"] = True
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
        items = [info["versions"].get("items") for info in health["replicas"].values()]
        check(items == [acked], f"the catalog after removal: {health['replicas']}")
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
