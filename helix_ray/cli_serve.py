"""The ``helix`` commands that run the Serve application: ``serve`` and ``demo``.
Imports stay inside the functions (``helix --help`` loads none of them)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from helix_ray.cli_common import format_answer, format_report, format_result, load_config_typed


def demo(args: argparse.Namespace) -> int:
    """``helix demo``: the shipped sample set ingested into ``--store``, then one recall,
    over HTTP (:func:`_demo_over_http`) or in this process (``--in-process``)."""
    from helix_ray.config import IngestConfig
    from helix_ray.ingest.run import ingest
    from helix_ray.memory import Memory

    sample = Path(__file__).parent / "samples" / "atlas"
    sources = [sample / "memories.jsonl", sample / "notes", sample / "transcript.jsonl", sample / "bad_records.jsonl"]
    import ray

    ours = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")  # a local Ray this command starts
    print(f"== ingest {sample} → {args.store} (runner: {args.runner})")
    report = ingest(sources, args.store, config=IngestConfig(), runner=args.runner)
    print(format_report(report))
    if args.in_process:
        with Memory(args.store, warm=False) as mem:
            print(f"\n== recall {args.query!r} for user dana (budget 400 tokens), in process")
            result = mem.recall(args.query, user="dana", budget_tokens=400, k=6)
            print(format_result(result))
    elif _demo_over_http(Path(args.store), args.query, ours, quiet=not args.verbose):
        return 1
    print(f"\n== next: the store stays in {args.store}; ask it yourself, in process: `source .venv/bin/activate`, "
          f"then `helix recall \"why NATS over Kafka?\" --store {args.store} --user dana`")
    return 0


def _demo_over_http(store: Path, query: str, ours: bool, *, quiet: bool = True) -> int:
    """The demo's recall through the server: the Helix Serve application on this Ray
    (127.0.0.1, a free port, the inline graph), a key for user dana, one
    ``POST /v1/recall`` — the request an agent or ``curl`` sends — then the key is
    revoked and what the demo started taken down (``ours``: the local Ray too)."""
    import urllib.request

    from helix_ray.runtime import spare_port
    from helix_ray.store.keys import KeyStore
    from helix_ray.serve.server import _take_down, run, serving_address

    _serve_driver_logs(quiet)
    port = spare_port()  # Serve binds it after Ray has started: not a port Ray's processes may take
    keys = KeyStore(store)
    key, record = keys.create("dana")
    try:
        run(store, host="127.0.0.1", port=port, graph="inline", quiet=quiet)
        host, port = serving_address("127.0.0.1", port)  # a cluster's Serve may run already, on its own port
        print(f"\n== serve {store} on http://{host}:{port} (Ray Serve, inline graph; `helix serve` runs the same)")
        url = f"http://{host}:{port}/v1/recall"
        body = {"query": query, "budget_tokens": 400, "k": 6}
        print(f"== POST {url} {json.dumps(body)} (user dana's API key)")
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        took = []
        for _ in range(2):  # the replica's first request loads what it had not touched yet
            clock = time.perf_counter()
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.load(response)
            took.append((time.perf_counter() - clock) * 1000)
        print(format_answer(answer, took))
    finally:
        keys.revoke(record.key_id)
        _take_down(ours)
    return 0


def serve(args: argparse.Namespace) -> int:
    """``helix serve``: the store on Ray Serve until Ctrl-C or SIGTERM."""
    from helix_ray.serve.server import serve_forever

    retrieval: dict[str, Any] = {}
    if args.retrieval_config:
        import yaml

        from helix_ray.config import RetrievalConfig

        load_config_typed(RetrievalConfig, args.retrieval_config, "--retrieval-config")  # checked before Ray starts
        retrieval = yaml.safe_load(Path(args.retrieval_config).read_text()) or {}
    if args.ha_proxy:
        if os.environ.get("RAY_ADDRESS"):
            print("helix serve: --ha-proxy applies only to a Ray this command starts; set "
                  "RAY_SERVE_ENABLE_HA_PROXY=1 where the cluster runs instead.", file=sys.stderr)
            return 2
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"  # read by Serve when it starts, in every Ray process
    from helix_ray.runtime import is_loopback
    from helix_ray.serve.server import check_exposure

    check_exposure(args.host, auth=not args.no_auth)  # before Ray starts
    if not is_loopback(args.host):
        print(f"helix serve: binding {args.host}: the API is reachable from other machines.", file=sys.stderr)
    _serve_driver_logs(quiet=not args.verbose)
    serve_forever(args.store, host=args.host, port=args.port, auth=not args.no_auth, create=True,
                  ingest_config=args.ingest_config, retrieval=retrieval, graph=serve_graph(args.graph, args.mirror),
                  quiet=not args.verbose, **({"mirror": args.mirror, "mirror_cache": args.mirror_cache}
                                             if args.mirror else {}))
    return 0


def _serve_driver_logs(quiet: bool) -> None:
    """Serve's logger in this process: warnings only when ``quiet``, else Serve's INFO
    lines (it started, it connected to itself, the application is ready), which Helix
    says in its own words. Set after importing Serve, which sets it up at import; the
    replicas and the controller keep their own logs in Ray's session folder."""
    import logging

    import ray.serve  # noqa: F401 - sets up its logger

    logging.getLogger("ray.serve").setLevel(logging.WARNING if quiet else logging.INFO)


def serve_graph(choice: str, mirror: str | None = None) -> str:
    """``--graph auto``: the inline graph (no hop) on a Ray this command starts, the split
    graph (a deployment per stage, scaled across nodes) on a cluster given by RAY_ADDRESS
    or with a mirror (whose recall replicas may run on any node)."""
    if choice != "auto":
        return choice
    return "split" if os.environ.get("RAY_ADDRESS") or mirror else "inline"
