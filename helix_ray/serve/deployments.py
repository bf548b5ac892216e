"""The shells of :mod:`helix_ray.serve.shells` as Serve deployments, with the resources
that let the whole graph run on 2 cores.

Every replica asks for a fraction of a CPU: replicas default to ``num_cpus=1``, and
three of those on a 2-CPU node never schedule (``serve.run`` blocks forever; see
``docs/operations.md``). At their autoscaling maxima the deployments below ask for
1.8 logical CPUs together. Hops are light and async, so ``max_ongoing_requests`` is
raised well above Serve's default of 5.
"""

from __future__ import annotations

from ray import serve

from helix_ray.serve import shells

#: Logical CPUs per replica (all fractional; see the module docstring).
CPUS = {"ingress": 0.2, "embedder": 0.2, "dense": 0.1, "bm25": 0.1, "ranker": 0.2, "writer": 0.1, "pipeline": 0.4}

RETRIEVER_AUTOSCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 3,
    "target_ongoing_requests": 4,
    "upscale_delay_s": 5,
    "downscale_delay_s": 60,
}

Embedder = serve.deployment(
    name="Embedder", ray_actor_options={"num_cpus": CPUS["embedder"]}, max_ongoing_requests=64,
)(shells.EmbedderShell)

DenseANN = serve.deployment(
    name="DenseANN", ray_actor_options={"num_cpus": CPUS["dense"]}, max_ongoing_requests=64,
    autoscaling_config=RETRIEVER_AUTOSCALING,
)(shells.DenseShell)

BM25 = serve.deployment(
    name="BM25", ray_actor_options={"num_cpus": CPUS["bm25"]}, max_ongoing_requests=64,
    autoscaling_config=RETRIEVER_AUTOSCALING,
)(shells.BM25Shell)

Ranker = serve.deployment(
    name="Ranker", ray_actor_options={"num_cpus": CPUS["ranker"]}, max_ongoing_requests=64,
    autoscaling_config={**RETRIEVER_AUTOSCALING, "max_replicas": 2},
)(shells.RankerShell)

# Exactly one: it owns the store's DuckDB file, which admits one writing process.
Writer = serve.deployment(
    name="Writer", num_replicas=1, ray_actor_options={"num_cpus": CPUS["writer"]}, max_ongoing_requests=16,
)(shells.WriterShell)

# The compact graph (``ServeArgs.graph = "compact"``): every recall stage in one replica.
Pipeline = serve.deployment(
    name="Pipeline", ray_actor_options={"num_cpus": CPUS["pipeline"]}, max_ongoing_requests=64,
    autoscaling_config={**RETRIEVER_AUTOSCALING, "max_replicas": 2},
)(shells.PipelineShell)
