"""What Serve's HTTP ingress costs per request here, under Ray Serve's own settings.

Each run is a new local Ray (2 CPUs) with the given environment variables set before it
starts, one FastAPI echo deployment shaped like Helix's ingress (``POST /v1/recall``, a JSON
body read, a ~5 KB JSON answer, access log off), and ``--requests`` sequential POSTs from
an aiohttp client on 127.0.0.1 after 50 of warm-up. Prints one JSON line per run.

    .venv/bin/python scripts/bench_serve_proxy.py --rounds 2 \\
        --env "" --env RAY_SERVE_PROXY_USE_GRPC=1 --env RAY_SERVE_ENABLE_HA_PROXY=1

``--env ""`` is Serve's defaults; several ``K=V`` in one ``--env`` are separated by commas.
Runs alternate within each round (the host drifts). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

ANSWER = {"items": [{"id": f"m{i}", "text": "x" * 400, "score": 0.5} for i in range(10)]}


def one_run(requests: int, method: str) -> dict:
    """In a fresh process (its environment set by the parent): Ray, the echo app, the loop."""
    import ray
    from fastapi import FastAPI
    from ray import serve

    from helix_ray.runtime import spare_port

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = spare_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=128)
    @serve.ingress(app)
    class Echo:
        @app.post("/v1/recall")
        async def recall(self, body: dict) -> dict:
            return ANSWER

        @app.get("/v1/recall")
        async def recall_get(self, query: str, user: str) -> dict:  # no body: no call back for it
            return ANSWER

    serve.run(Echo.bind(), name="echo", route_prefix="/",
              logging_config={"enable_access_log": False, "log_level": "WARNING"})

    async def loop() -> list[float]:
        import aiohttp

        times, url = [], f"http://127.0.0.1:{port}/v1/recall"
        async with aiohttp.ClientSession() as session:
            for i in range(requests + 50):
                clock = time.perf_counter()
                fields = {"query": f"query {i}", "user": "u"}
                async with (session.post(url, json=fields) if method == "post"
                            else session.get(url, params=fields)) as response:
                    await response.json()
                if i >= 50:
                    times.append((time.perf_counter() - clock) * 1000)
        return times

    try:
        times = sorted(asyncio.run(loop()))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"p50": round(times[len(times) // 2], 2), "p95": round(times[int(len(times) * 0.95)], 2),
            "p99": round(times[int(len(times) * 0.99)], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", action="append", default=None,
                        help='"K=V[,K=V...]" for one setting; "" for Serve\'s defaults (repeat)')
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--method", choices=["post", "get"], default="post",
                        help="post: a JSON body, as Helix's recall; get: the same fields as query parameters "
                             "(no request body for the replica to fetch from the proxy)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.requests, args.method)), flush=True)
        return
    settings = args.env if args.env is not None else [""]
    for round_ in range(args.rounds):
        for setting in settings:
            extra = dict(part.split("=", 1) for part in setting.split(",") if part)
            done = subprocess.run([sys.executable, __file__, "--child", "--requests", str(args.requests),
                                   "--method", args.method],
                                  env={**os.environ, **extra}, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"run with {extra or 'defaults'} failed:\n{done.stderr[-3000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"round": round_, "method": args.method, "env": extra, **figures}), flush=True)


if __name__ == "__main__":
    main()
