"""A Ray cluster of boxd nodes on this machine, driven over stdin (for tests and bench).

Run inside a network namespace that has only ``lo`` (see docs/cluster.md): Ray then
advertises 127.0.0.1 and no traffic leaves the machine. Prints one JSON line
``{"address": ..., "nodes": [ids]}`` once the nodes are up, then obeys lines on stdin:
``remove I`` (remove the I-th boxd node; prints ``{"removed": id}``), ``add`` (one more
boxd node; prints ``{"added": id}``) and ``quit``.
"""

from __future__ import annotations

import json
import sys

from ray.cluster_utils import Cluster


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1, resources={"boxd": 1}) for _ in range(count)]
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "nodes": [n.node_id for n in nodes]}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "remove":
            node = nodes[int(cmd[1])]
            cluster.remove_node(node)
            print(json.dumps({"removed": node.node_id}), flush=True)
        elif cmd[0] == "add":
            node = cluster.add_node(num_cpus=1, resources={"boxd": 1})
            nodes.append(node)
            cluster.wait_for_nodes()
            print(json.dumps({"added": node.node_id}), flush=True)
        elif cmd[0] == "quit":
            break
    cluster.shutdown()


if __name__ == "__main__":
    main()
