"""Kill one replica of a Helix deployment while a client recalls in a loop; print what the
client saw (statuses, slowest answers, how many were degraded or failed and until when)
until Serve has replaced it.

    .venv/bin/python scripts/drill_replica_loss.py --graph inline --deployment HelixAPI --replicas 2

A new local Ray (4 CPUs) serves the tests' four-tenant store (ingested into --work) with
``retriever_replicas=(N, N)`` — for the inline graph, N ingress replicas. The replica is
killed with ``ray.kill(..., no_restart=True)``, as a crash would; the loop sends recalls
back to back for ``--seconds``. See docs/operations.md on a replica that dies.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", choices=["split", "compact", "inline"], default="inline")
    parser.add_argument("--deployment", default="HelixAPI", help="whose replica to kill (a deployment of --graph)")
    parser.add_argument("--replicas", type=int, default=2, help="retriever_replicas (min = max)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--work", default="/tmp/helix-drill")
    args = parser.parse_args()

    import httpx
    import ray
    from ray import serve

    from helix_ray.runtime import spare_port
    from helix_ray.serve import server
    from helix_ray.store.keys import KeyStore
    from helix_ray.ingest.run import ingest
    from tests.helpers import tenant_records

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    source = work / "tenants.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()))
    store = work / "store"
    assert ingest([source], store, runner="local", show_progress=False).published
    key = KeyStore(store).create("alice")[0]
    server.start_ray(num_cpus=4)
    port = spare_port()
    server.run(store, port=port, compact_interval_s=3600, graph=args.graph,
               retriever_replicas=(args.replicas, args.replicas))

    body = {"query": "what is the deploy process?", "budget_tokens": 400, "k": 8}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as client:
        for _ in range(20):
            client.post("/v1/recall", json=body)
        before = server.replica_names(args.deployment)
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        start, seen = time.monotonic(), []
        while time.monotonic() - start < args.seconds:
            clock = time.monotonic()
            try:
                response = client.post("/v1/recall", json=body)
                status = response.status_code
                degraded = response.json()["flags"].get("degraded") if status == 200 else response.text[:120]
            except httpx.HTTPError as exc:
                status, degraded = type(exc).__name__, str(exc)[:120]
            seen.append((round(clock - start, 2), status, round(time.monotonic() - clock, 3), degraded))
    unclean = [s for s in seen if s[1] != 200 or s[3]]  # an error, or an answer flagged degraded
    statuses: dict = {}
    for _, status, _, _ in seen:
        statuses[status] = statuses.get(status, 0) + 1
    print(json.dumps({"graph": args.graph, "deployment": args.deployment, "replicas_before": len(before),
                      "killed": before[0], "requests": len(seen), "statuses": statuses,
                      "slowest": sorted(seen, key=lambda s: -s[2])[:3],
                      "not_clean": len(unclean), "first_not_clean": unclean[:5],
                      "last_not_clean_at_s": unclean[-1][0] if unclean else None,
                      "replaced": sorted(set(server.replica_names(args.deployment)) - set(before))}, default=str))
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
