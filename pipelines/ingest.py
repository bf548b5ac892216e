"""The ingest job on Ray Data: the dataflow wiring of :mod:`helix_ray.ingest.run`.

For ``runner="ray"``, stages 1–2 run as Ray Data tasks, one per source
(:func:`read_validate`), stages 4, 5 and 7a on a pool of embedding actors fed as
stage 3 finishes (:class:`_TransformFeed`), and stage 7b's HNSW builds and searches as
Ray tasks (:class:`RayTasks`); the stages themselves, and every other step of a run,
are :mod:`helix_ray.ingest`'s. ``helix_ray.ingest.run`` imports this module
only when a run asks for Ray.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import warnings
from collections import Counter
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa

import helix_ray.ingest.run as ingest_run
from helix_ray.config import IngestConfig
from helix_ray.errors import HelixError
from helix_ray.ingest import stages
from helix_ray.ingest.run import Run, read_validate_sign, stage
from helix_ray.runtime import ensure_ray, ray_output_shown

log = logging.getLogger(__name__)
T = TypeVar("T")

ROWS_OUT = 4096  # read rows turned into Python objects at a time (:func:`read_validate`)
BLOCK = 256  # rows per Ray Data block (a multiple of BATCH; blocks are the actors' unit of work)
ACTOR_MEMORY = 1792 * 1024**2  # what one embedding actor holds (two models and their arenas): told to Ray
#: Restarts of an embedding actor whose process died on a cluster, each retrying the
#: batch it held (``embed_actor_restarts`` None): a worker lost mid-ingest costs a model
#: load, while one that dies on every batch (out of memory) fails the run instead of
#: restarting forever.
ACTOR_RESTARTS = 3


def actor_restarts(config: IngestConfig) -> int:
    """``config.embed_actor_restarts``, or by where the ingest runs: restarts on a cluster
    (``RAY_ADDRESS``), none on a Ray of its own (an actor that dies there was most likely
    killed for memory, and Ray logs an error line per actor it may restart)."""
    if config.embed_actor_restarts is not None:
        return config.embed_actor_restarts
    return ACTOR_RESTARTS if os.environ.get("RAY_ADDRESS") else 0


def run_stages(run: Run, items: list[dict[str, str]], stages_of: Callable[[Run, list[dict[str, str]]], None]) -> None:
    """``stages_of(run, items)`` with Ray Data: Ray started (or the cluster of
    ``RAY_ADDRESS`` joined), blocks kept in order, and ``run.feed`` the transform stage,
    ended after the run, or aborted when it fails."""
    import ray

    with stage(run, "ray_start"):
        ensure_ray()
    quiet_ray_data(not ray_output_shown())
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    feed = _TransformFeed(run.config, on_rows=run.progress.advance)
    run.feed = feed
    tasks = RayTasks()
    if tasks.slots:  # else (a head node started with no CPU for tasks) the units run in this process
        run.tasks = tasks
    try:
        stages_of(run, items)
    except BaseException:
        feed.abort()
        raise
    feed.close()


class RayTasks:
    """Stage 7b's HNSW units (:mod:`helix_ray.ingest.dense`) as Ray tasks of one CPU
    each, all submitted at once and their results taken in order. A unit given paths
    runs on the driver's node: the files it reads and writes are on its disk (the
    store's). A unit given its inputs (``anywhere``: the searches, on a cluster of
    several nodes) runs on any node, the units spread over them."""

    threads = 1  # one search thread per task: the tasks are the parallelism

    def __init__(self) -> None:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]}
        self.slots = cpus.get(self.node, 0)  # the driver's node's CPUs: units that run at once
        self.nodes = sum(1 for c in cpus.values() if c > 0)
        self.spread_slots = sum(cpus.values())
        self.units: Counter[str] = Counter()

    def share(self, value: np.ndarray) -> Any:
        import ray

        return ray.put(value)

    def map(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], *,
            anywhere: bool = False) -> Iterator[T]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        where = "SPREAD" if anywhere else NodeAffinitySchedulingStrategy(self.node, soft=False)
        name = getattr(getattr(fn, "func", fn), "__name__", "unit")  # as Ray shows it (a partial's function)
        remote = ray.remote(num_cpus=1)(_on_node).options(scheduling_strategy=where, name=name)
        refs = [remote.remote(fn, *call) for call in calls]
        refs.reverse()
        while refs:  # each result is let go of once the caller has taken it
            node, result = ray.get(refs.pop())
            self.units[node] += 1
            yield result


def _on_node(fn: Callable[..., T], *args: Any) -> tuple[str, T]:
    """``fn(*args)`` in a Ray task, with the id of the node it ran on."""
    import ray

    return ray.get_runtime_context().get_node_id(), fn(*args)


def quiet_ray_data(quiet: bool) -> None:
    """Ray Data's own output in this process. ``quiet``: no execution plan and no
    progress (the run shows its own, :mod:`helix_ray.ingest.progress`), and its console
    handler shows errors only; its full log still goes to the Ray session's
    ``logs/ray-data`` folder. Else Ray Data's defaults."""
    import logging

    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = not quiet
    context.print_on_execution_start = not quiet
    # Errors only, not warnings: with its progress bars off, Ray Data warns that they are.
    for handler in logging.getLogger("ray.data").handlers:
        if handler.get_name() == "console":
            handler.setLevel(logging.ERROR if quiet else logging.INFO)


def read_validate(items: list[dict[str, str]], config: IngestConfig) -> Iterator[dict[str, Any]]:
    """Stages 1–2 as Ray Data tasks, one per source (:func:`read_validate_sign`), their
    rows streamed to the driver: it holds one Arrow block and :data:`ROWS_OUT` of its
    rows as Python objects at a time, not every payload of the run at once."""
    import ray

    ds = ray.data.from_items(items).flat_map(
        read_validate_sign,  # type: ignore[arg-type]  # ray's UDF type does not model fn_kwargs
        fn_kwargs={"config": config}, num_cpus=0.25,
    )
    for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        assert isinstance(block, pa.Table)
        for start in range(0, block.num_rows, ROWS_OUT):
            yield from block.slice(start, ROWS_OUT).to_pylist()


class _TransformFeed:
    """Stages 4, 5 and 7a on Ray Data, started before their input exists.

    The embedding actors are slow to start (a new worker process, Ray Data's and
    Helix's imports, two models): idle time on a small ingest if they start when their
    stage begins. So :meth:`start` runs as soon as the driver knows some rows are new:
    the actors start while the driver deduplicates (stage 3); :meth:`run` then hands the
    stage the rows to transform, :meth:`close` ends it unfed (dedup left nothing to
    embed) and :meth:`abort` after an error elsewhere. They start after read + validate,
    not before it: their start-up would take the cores the read tasks need
    (docs/benchmarks.md).

    The stage reads its input from a :class:`_Mailbox`: one read task per ``BLOCK``
    rows there could be (the new rows, counted before dedup drops any), run one at a
    time, each waiting for the rows and returning its block, or nothing past the last.
    So every block is exactly a ``BLOCK``-row slice, the actors see the same
    ``BATCH``-row batches as the local runner (:data:`helix_ray.ingest.run.BATCH`), and both runners produce identical
    vectors (the int8 model quantizes activations per batch). The read tasks ask Ray for
    no CPU: the actors may hold every core.
    """

    def __init__(self, config: IngestConfig, on_rows: Callable[[int], None] = lambda rows: None):
        import threading

        self.config = config
        self.on_rows = on_rows  # told how many rows each transformed block holds, as it arrives
        self.thread: threading.Thread | None = None
        self.mailbox: Any = None  # a Ray actor handle of _Mailbox
        self.stop = threading.Event()
        self.batches: queue.Queue[dict[str, np.ndarray] | None] = queue.Queue()  # None: the stage ended
        self.error: BaseException | None = None
        self.restarts = actor_restarts(config)

    def start(self, max_rows: int) -> None:
        import threading

        import ray

        config = self.config
        self.mailbox = ray.remote(num_cpus=0)(_Mailbox).remote()
        blocks = max(1, -(-max_rows // BLOCK))
        actors, memory = _embed_actors(config, blocks)
        restarts = self.restarts
        ds = ray.data.read_datasource(_mailbox_source(self.mailbox, blocks), override_num_blocks=blocks,
                                      num_cpus=0, concurrency=1)
        with warnings.catch_warnings():
            # A pool actor whose process dies (a lost worker or node) is restarted and the
            # batch it held is run again, up to ``restarts`` times (actor_restarts): the
            # run goes on, and every row is still embedded once. Ray Data hands each actor
            # its transform as object-store references, which a restart needs: Ray logs an
            # error line per actor saying so, and the driver holds them until the stage ends.
            # A batch is retried for as long as its actor may come back (-1): an actor on a
            # lost node is unreachable until the GCS's health checks mark the node dead,
            # and a bounded count of retries runs out in that while. Once its restarts are
            # used up, the actor is dead and its batch fails. Ray Data takes max_restarts
            # only among its remote arguments, which it marks deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            ds = ds.map_batches(stages.Transform, fn_constructor_args=(config, config.embed_actor_threads),
                                batch_size=ingest_run.BATCH, num_cpus=config.embed_actor_cpus, memory=memory,
                                compute=ray.data.ActorPoolStrategy(size=actors), max_restarts=restarts,
                                max_task_retries=-1 if restarts else 0)
        self.thread = threading.Thread(target=self._drain, args=(ds,), name="helix-transform", daemon=True)
        self.thread.start()

    def _drain(self, ds) -> None:
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                if self.stop.is_set():
                    break  # aborted: leaving the iterator shuts the execution down
                if len(batch.get("seq", ())):
                    self.batches.put(batch)
                    self.on_rows(len(batch["seq"]))
        except BaseException as exc:  # re-raised in the driver's thread by run()
            self.error = exc
        finally:
            self.batches.put(None)

    def run(self, table: pa.Table) -> Iterator[dict[str, np.ndarray]]:
        """The transformed batches of ``table``'s rows, as they arrive (in any order)."""
        import ray

        # The blocks go to the object store once; the mailbox holds their references.
        order = _longest_first(table.column("text").to_pylist(), BLOCK, self.config.embedder.batch_size)
        self._post([ray.put(table.slice(i, BLOCK)) for i in order])
        del table
        while (batch := self.batches.get()) is not None:
            yield batch
        self._join()
        if isinstance(self.error, ray.exceptions.ActorDiedError):
            died = (f"died more often than it is restarted ({self.restarts} times)" if self.restarts else
                    "died (embed_actor_restarts is 0 on a Ray of its own; set it in --config to restart actors)")
            raise HelixError(
                f"An embedding actor's process {died}: {str(self.error).splitlines()[0]} Nothing was published, "
                "the store's current generation is unchanged. If the machine is short of memory (`dmesg` shows "
                "the OOM killer), lower embed_actors or embed_actor_threads in the ingest config (--config), then "
                "run the same ingest again."
            ) from self.error
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """End the stage unfed (nothing was left to embed)."""
        if self.thread is not None:
            self._post([])
            self._join()
            if self.error is not None:
                log.warning("the unused transform stage failed: %s", self.error)

    def abort(self) -> None:
        """End the stage after an error elsewhere, without waiting for the actors to
        start: the mailbox goes, so every read task fails at once."""
        if self.thread is not None:
            import ray

            self.stop.set()
            ray.kill(self.mailbox, no_restart=True)
            self.thread.join(timeout=60)
            if self.thread.is_alive():
                log.warning("the transform stage did not stop within 60 s of an ingest error; it ends with Ray")
            self.thread = None

    def _post(self, refs: list) -> None:
        assert self.thread is not None
        # In a list: Ray would resolve references passed as arguments themselves.
        self.mailbox.publish.remote([refs])

    def _join(self) -> None:
        assert self.thread is not None
        self.thread.join()
        self.thread = None


class _Mailbox:
    """The rows of :class:`_TransformFeed`, as ``BLOCK``-row object references: read task
    ``k`` waits for them and takes the ``k``-th (a Ray actor, asking for no CPU)."""

    def __init__(self) -> None:
        import asyncio

        self.ready = asyncio.Event()
        self.refs: list = []

    async def publish(self, refs: list) -> None:
        self.refs = refs[0]
        self.ready.set()

    async def block(self, k: int) -> list:
        await self.ready.wait()
        return self.refs[k:k + 1]


def _longest_first(texts: list[str], block: int, model_batch: int) -> list[int]:
    """The offsets of ``block``-row slices of ``texts``, costliest first: the actors take
    blocks in this order, so the last ones out are the cheapest and the actors finish
    close together (longest-processing-time-first). Which rows make a block does not
    change, so neither do the vectors — provided a short last slice stays last: the
    actor stage bundles blocks until it has a batch's rows, so a short block sent early
    would be merged with the next one into other batches.

    The cost of a block is what the embedder pads it to: its texts sorted by length, in
    batches of ``model_batch``, each as long as its longest text (characters stand in
    for tokens)."""
    def cost(i: int) -> int:
        lengths = sorted(len(t) for t in texts[i:i + block])
        return sum(len(lengths[j:j + model_batch]) * lengths[min(j + model_batch, len(lengths)) - 1]
                   for j in range(0, len(lengths), model_batch))

    starts = list(range(0, len(texts), block))
    short = [starts.pop()] if len(texts) % block else []
    return sorted(starts, key=lambda i: (-cost(i), i)) + short


def _mailbox_source(mailbox, blocks: int):
    """A Ray Data datasource of ``blocks`` read tasks, task ``k`` returning the ``k``-th
    block of ``mailbox`` (ray.data imported here: ``helix --help`` and the local runner
    never need it)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def read(k: int):
        import ray

        for ref in ray.get(mailbox.block.remote(k)):
            yield ray.get(ref)

    class MailboxSource(Datasource):
        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(functools.partial(read, k), meta) for k in range(blocks)]

    return MailboxSource()


def _embed_actors(config: IngestConfig, n_blocks: int) -> tuple[int, int]:
    """How many embedding actors, and the memory each tells Ray it holds: no more actors
    than blocks, nor than the cluster's memory fits (one at least, asking for what is
    there: Ray would otherwise never place it)."""
    import ray

    room = int(ray.cluster_resources().get("memory", 0))
    fits = max(1, room // ACTOR_MEMORY)
    actors = max(1, min(config.embed_actors, n_blocks, fits))
    if actors < config.embed_actors and actors < n_blocks:
        # A warning only when embed_actors was asked for: the default on a small host is
        # nothing its user can act on.
        say = log.warning if "embed_actors" in config.model_fields_set else log.info
        say("embed_actors=%d but this Ray's memory (%.1f GiB) fits %d embedding actor(s) of %.1f GiB; running %d",
            config.embed_actors, room / 1024**3, fits, ACTOR_MEMORY / 1024**3, actors)
    return actors, min(ACTOR_MEMORY, room)
