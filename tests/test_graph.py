"""Stage 7b's entity nodes and mention edges, counted by hand on a small tenant pair."""

import numpy as np
import pyarrow as pa
import pytest

from helix_ray.config import GraphBuildConfig
from helix_ray.ingest.graph import MENTION, build_graph


@pytest.mark.parametrize("as_arrow", [False, True], ids=["lists", "arrow"])
def test_entity_nodes_count_each_memory_once_per_tenant_and_skip_singletons_and_hubs(as_arrow):
    users = ["bob", "bob", "bob", "ann", "ann", "ann", "ann"]
    lists = [["redis", "redis", "kafka"],  # bob: redis twice in one memory counts once
             ["redis"], ["zeta"],           # bob: zeta once, a singleton
             ["kafka", "hub"], ["kafka", "hub"], ["hub"], ["hub"]]  # ann: hub in 4 of 4
    config = GraphBuildConfig(knn=0, temporal_window=0, min_entity_df_cap=3, max_entity_df=0.5)
    graph, entities = build_graph(
        users=users, sessions=[None] * 7, order_keys=[0] * 7,
        entity_lists=pa.array(lists, pa.list_(pa.string())) if as_arrow else lists, knn=None,
        partitions={"bob": (0, 3), "ann": (3, 7)}, config=config)
    # (user, key) order; bob's kafka is mentioned once in bob's tenant (ann's do not count)
    assert entities.to_pylist() == [
        {"node": 7, "user": "ann", "key": "kafka", "df": 2},
        {"node": 8, "user": "bob", "key": "redis", "df": 2},
    ]  # ann's hub: df 4 > max(3, 0.5 · 4); zeta and bob's kafka: df 1
    edges = {(row, int(graph.indices[i]), round(float(graph.weights[i]), 4))
             for row in range(7) for i in range(graph.indptr[row], graph.indptr[row + 1])
             if graph.types[i] == MENTION}
    w = round(1 / np.sqrt(2), 4)
    assert edges == {(3, 7, w), (4, 7, w), (0, 8, w), (1, 8, w)}
    assert graph.num_nodes == 9
