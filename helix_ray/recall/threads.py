"""Thread control on the query path: BLAS on the calling thread during a recall, the
onnxruntime threads of the two query encoders, and the pool that encodes a query's
late-interaction tokens alongside the rest of its recall.

On a small host the query's two encoders and numpy's BLAS compete for the same cores;
these keep each on its own (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from helix_ray.config import RetrievalConfig
from helix_ray.runtime import usable_cores


def elapsed_ms(since: float) -> float:
    """Milliseconds since ``since`` (a ``time.perf_counter()`` reading), to the µs."""
    return round((time.perf_counter() - since) * 1000.0, 3)


class _BlasOnCaller:
    """While a recall runs, numpy's and scipy's BLAS compute on the calling thread
    alone. The query path's products are small (MMR, MaxSim, a few hundred rows), and an
    idle OpenBLAS worker spins for a while after each call on the other core: the very
    core the query's token encoder runs on (docs/benchmarks.md).

    OpenBLAS's thread count is the process's. The recall that enters when no other holds
    the limit sets it and, when it leaves, restores the caller's setting and gives up
    threadpoolctl's control; a recall that starts on another thread meanwhile runs under
    that limit and never sets or restores anything (a restore from it would put back the
    limit itself, for good)."""

    def __init__(self) -> None:
        self._local = threading.local()  # this thread's nesting depth
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread whose recall set the limit
        self._limiter: Any = None
        self._controller: Any = None

    def __enter__(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        with self._lock:
            if self._owner is not None:
                return
            if self._controller is None:
                from threadpoolctl import ThreadpoolController

                self._controller = ThreadpoolController()  # numpy and scipy are loaded by now
            limiter = self._controller.limit(limits=1, user_api="blas")
            limiter.__enter__()  # threadpoolctl's ownership count: released by __exit__
            self._owner, self._limiter = threading.current_thread(), limiter

    def __exit__(self, *exc: Any) -> None:
        self._local.depth -= 1
        if self._local.depth:
            return
        with self._lock:
            if self._owner is threading.current_thread():
                limiter, self._limiter, self._owner = self._limiter, None, None
                limiter.__exit__(None, None, None)  # restores the limits, then gives up the control


#: The process's one BLAS limit for recalls (a context manager; nests).
blas_on_caller = _BlasOnCaller()


def one_blas_thread(method: Any) -> Any:
    """Run ``method`` inside :data:`blas_on_caller`."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with blas_on_caller:
            return method(*args, **kwargs)

    return wrapped


def late_on(cfg: RetrievalConfig, disabled: frozenset[str] = frozenset()) -> bool:
    """The late-interaction stage is switched on (whether the generation has tokens aside)."""
    return cfg.late.enabled and cfg.late.weight > 0 and "late" not in disabled


def encoder_threads(generation: Any, config: RetrievalConfig | None = None) -> int | None:
    """onnxruntime threads for an in-process recaller's two query encoders: half the
    cores each when the query's tokens will be encoded alongside its sentence vector (a
    generation with token vectors, late interaction on, two cores or more), so the two do
    not spin against each other; otherwise None, onnxruntime's default (every core)."""
    late = late_on(config or RetrievalConfig()) and generation is not None and generation.late is not None
    cores = usable_cores()
    return cores // 2 if late and cores > 1 else None


def overlap_tokens(threads: int | None) -> bool:
    """Whether a recaller whose encoders have ``threads`` onnxruntime threads each encodes
    a query's tokens on another thread while the sentence vector and the legs run: only
    when the two encoders' threads fit in the cores together (with onnxruntime's default,
    every core each, the two would contend: docs/benchmarks.md)."""
    return bool(threads) and 2 * (threads or 0) <= usable_cores()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def token_pool() -> ThreadPoolExecutor:
    """The threads that encode queries' late-interaction tokens alongside the rest of
    their recall (one per core beyond the caller's; created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, usable_cores() - 1), thread_name_prefix="helix-query-tokens")
        return _pool


def encode_tokens(encoder: Any, query: str) -> tuple[np.ndarray, float]:
    """The query's late-interaction tokens (float16) and the encoder's milliseconds."""
    clock = time.perf_counter()
    return encoder.encode_query(query).astype(np.float16), elapsed_ms(clock)
