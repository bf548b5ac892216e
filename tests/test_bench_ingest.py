"""``scripts/bench_ingest.py --nodes``: the per-node summary from the cluster's state
rows (fabricated here) and the flags its cluster run repeats. The two-node run itself is
the script's to exercise (it starts a cluster and the models)."""

from __future__ import annotations

from tests.helpers import load_script


def _bench():
    return load_script("bench_ingest")


def _call(node: str, created: int, start: int, end: int) -> dict:
    return {"node_id": node, "actor_id": f"actor-{node}", "created_ms": created, "start_ms": start, "end_ms": end}


PROBE = {
    "nodes": ["head0000aaaa", "work1111bbbb"],
    "actors": [{"node_id": "head0000aaaa", "actor_id": "a", "state": "DEAD"},
               {"node_id": "work1111bbbb", "actor_id": "b", "state": "DEAD"}],
    # 600 rows in blocks of 256: 256, 256 and the last-created block's 88
    "calls": [_call("work1111bbbb", 1_000, 1_000, 9_000), _call("head0000aaaa", 500, 600, 8_600),
              _call("work1111bbbb", 2_000, 9_000, 11_000)],
}


def test_rows_per_node_give_the_short_last_block_to_the_call_created_last():
    head, worker = _bench().per_node(PROBE, rows=600, stage_s=10.0, block=256)
    assert (head["node"], head["node_id"], head["actors"], head["blocks"], head["rows"]) == ("head", "head0000", 1, 1, 256)
    assert (worker["node"], worker["blocks"], worker["rows"]) == ("worker 1", 2, 344)
    assert (head["mem_per_s"], worker["mem_per_s"]) == (25.6, 34.4)  # rows / the stage's 10 s
    assert (head["busy_s"], worker["busy_s"]) == (8.0, 10.0)
    assert worker["mem_per_busy_s"] == 34.4


def test_calls_that_do_not_add_up_to_the_rows_leave_rows_unknown():
    for rows in (512, 900):  # the calls hold more than 512 rows; 900 would need a fourth
        out = _bench().per_node(PROBE, rows=rows, stage_s=10.0, block=256)
        assert [n["rows"] for n in out] == [None, None] and [n["blocks"] for n in out] == [1, 2]
        assert [n["mem_per_s"] for n in out] == [None, None]


def test_the_cluster_run_repeats_the_flags_that_shape_a_pipeline_run():
    bench = _bench()
    args = bench.argparse.Namespace(nodes=2, node_cpus=1, pipeline_env=["OMP_NUM_THREADS=2"],
                                    data_no_progress_timeout=None, no_late=True, code=None)
    assert bench.child_flags(args) == ["--nodes=2", "--node-cpus=1", "--pipeline-env=OMP_NUM_THREADS=2", "--no-late"]
