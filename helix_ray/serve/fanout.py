"""The split graph's fan-out: one recall over the Embedder, the two retriever legs and
the Ranker, with timeouts, so that a missing stage degrades the answer instead of
failing it.

The ingress sends the whole graph at once (the plan's response goes straight into both
legs, theirs into the Ranker) and waits at most ``leg_timeout_s``. Past that the calls
are reused, not sent again: the plan and the legs get a short grace, a missing leg is
left out and flagged in ``flags.degraded``, a missing Embedder leaves BM25 alone on a
plan made without the query vector. A stage taken for missing gets a shorter bound
until its probe (a late call kept running) answers. :class:`SplitGraph` holds these
steps as methods of the ingress (see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Protocol, Sequence

from ray.serve.handle import DeploymentHandle

from helix_ray.config import RetrievalConfig
from helix_ray.errors import StoreError
from helix_ray.recall.pipeline import Recaller
from helix_ray.serve.errors import callers_mistake, kind_of

log = logging.getLogger(__name__)

#: After the graph's ``leg_timeout_s``: the legs' grace when the plan was in by then
#: (seconds), and how long the plan may take to come back for that to hold.
LEG_GRACE_S = 0.2
LATE_PLAN_S = 0.05
#: The graph's bound (seconds) while a leg that ran out of time has not answered since.
MISSING_LEG_TIMEOUT_S = 0.25


class LegTimedOut(Exception):
    """A stage of the split graph (a retriever leg, the Embedder) that did not answer in time."""


def _drop(call: "asyncio.Future[Any]") -> None:
    """Cancel a task over a handle call no one will await; if it has ended, its error
    counts as read (asyncio would log one never retrieved)."""
    if call.done():
        if not call.cancelled():
            call.exception()
    else:
        call.cancel()


class CallCancelled(Exception):
    """A handle call cancelled under this request, not by it: a failure like any other."""


async def _settle(call: "asyncio.Future[Any]", wait_s: Optional[float]) -> Any:
    """The result of ``call`` (a task over a handle call) within ``wait_s`` seconds
    (None: no bound), else :class:`LegTimedOut` with the call left running, to be waited
    for again. Never cancels it, unless this request itself is cancelled: a
    ``DeploymentResponse`` awaited under a timeout that expires while Serve is still
    routing it (no live replica) is cancelled for good, and a later await raises
    ``CancelledError`` (Ray 2.60 wraps its routing future with ``asyncio.wrap_future``)."""
    try:
        done, _ = await asyncio.wait({call}, timeout=wait_s)
    except asyncio.CancelledError:
        call.cancel()
        raise
    if not done:
        raise LegTimedOut()
    if call.cancelled():
        raise CallCancelled("the call was cancelled")
    return call.result()


def _unsearchable(why: str) -> StoreError:
    """The 503 of a split graph with no stage left that can search (``why``)."""
    return StoreError(f"The store cannot be searched right now: {why}, as while Serve replaces lost replicas. "
                      "Retry in a few seconds.")


def _failure(exc: BaseException, timeout_s: float) -> str:
    """How a stage failed, for ``flags.degraded``."""
    return f"no answer within {timeout_s:.2g} s" if isinstance(exc, LegTimedOut) else type(exc).__name__


class _LegBound(Protocol):
    leg_timeout_s: float


class SplitGraph:
    """The split graph's recall steps, a base of the ingress (:class:`helix_ray.serve.app.HelixAPI`),
    over its handles and the state below."""

    args: _LegBound
    embedder: Optional[DeploymentHandle]
    bm25: Optional[DeploymentHandle]
    dense: Optional[DeploymentHandle]
    ranker: Optional[DeploymentHandle]
    #: Stages that ran out of time and have not answered since (the legs, or "embedder").
    _legs_missing: set[str]
    #: What makes a plan here while the Embedder is missing.
    _vectorless: Recaller
    #: A late call kept per missing stage: see :meth:`_probe`.
    _probes: dict[str, asyncio.Future[Any]]

    async def _recall_split(self, query: str, user: str, config: RetrievalConfig,
                            request: dict[str, Any]) -> dict[str, Any]:
        """One await for the whole split graph: the plan's DeploymentResponse goes straight
        into both legs (Serve resolves it; the ingress never unpickles the plan), and the
        legs' responses straight into the Ranker."""
        # Only the split graph comes here, and build_app binds all four of its handles.
        assert self.embedder is not None and self.bm25 is not None
        assert self.dense is not None and self.ranker is not None
        plan = self.embedder.plan.remote(query, user=user, config=config, **request)
        lexical, dense = self.bm25.search.remote(plan), self.dense.search.remote(plan)
        finish = self.ranker.finish.remote(plan, lexical, dense)
        # A leg with no live replica (it died; Serve is starting another) does not fail:
        # its call waits in Serve's router, and the Ranker's call on it. Bounded here;
        # while a leg is missing, more tightly (each recall of an agent's turn would
        # otherwise wait the whole bound until Serve has replaced the replica).
        bound = self._bound(bool(self._legs_missing))
        finishing = asyncio.ensure_future(finish)
        try:
            out = await _settle(finishing, bound)
            self._legs_missing.clear()
            return out
        except LegTimedOut:
            return await self._recall_late(query, user, config, request, (plan, lexical, dense, finish), finishing,
                                           bound)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake, said by the replica that found it
            # A swap between the two legs' replicas, or a leg replica that failed: run the
            # legs again one by one, so one failing leg degrades the answer instead of failing it.
            log.warning("recall graph failed (%s); answering step by step", kind_of(exc) or type(exc).__name__)
            return await self._recall_stepwise(query, user, config, request)

    async def _recall_late(self, query: str, user: str, config: RetrievalConfig, request: dict[str, Any],
                           calls: tuple[Any, Any, Any, Any], finishing: "asyncio.Future[Any]",
                           bound: float) -> dict[str, Any]:
        """The graph did not answer within ``bound`` seconds (``leg_timeout_s``, or less
        while a stage is missing): its calls are reused, not sent again. The plan gets
        ``leg_timeout_s`` more (``bound`` more while the Embedder is known missing); past
        that the Embedder is taken for gone: BM25 alone answers, on a plan made here, and
        the plan call is left running as the Embedder's probe (:meth:`_probe`).
        The legs get a moment's grace (the full ``leg_timeout_s`` if the plan itself was
        late); if both then answer, the Ranker is slow, not gone, and its call is awaited;
        otherwise it is cancelled and the legs that answered are ranked. ``calls``: the
        graph's plan, lexical, dense and finish calls; ``finishing``: the task awaiting
        the last."""
        plan, lexical, dense, finish = calls
        planning = asyncio.ensure_future(plan)
        kept: list[Any] = []  # calls left running as a stage's probe

        def give_up() -> None:
            _drop(finishing)
            for call in calls:
                if call not in kept:
                    call.cancel()  # best effort: a call Serve has sent on runs to its end
            if plan not in kept:
                _drop(planning)

        try:
            clock = time.perf_counter()
            plan_wait = self._bound("embedder" in self._legs_missing)
            try:
                planned = await _settle(planning, plan_wait)
            except LegTimedOut as exc:
                if self._probe("embedder", planning):
                    kept.append(plan)
                give_up()
                return await self._recall_unplanned(query, user, config, request, _failure(exc, bound + plan_wait))
            except Exception as exc:  # noqa: BLE001
                if callers_mistake(exc):
                    raise
                give_up()
                return await self._recall_stepwise(query, user, config, request)
            self._legs_missing.discard("embedder")
            late_plan = time.perf_counter() - clock > LATE_PLAN_S
            wait_s = self.args.leg_timeout_s if late_plan else min(LEG_GRACE_S, self.args.leg_timeout_s)
            legs = await asyncio.gather(self._stage("bm25", lexical, wait_s, kept),
                                        self._stage("dense", dense, wait_s, kept), return_exceptions=True)
            if not any(isinstance(leg, BaseException) for leg in legs):
                try:
                    return await _settle(finishing, None)
                except Exception as exc:  # noqa: BLE001 - e.g. the legs straddled a swap: ranked here
                    if callers_mistake(exc):
                        raise
            give_up()
            log.warning("recall graph took over %g s; answering with the legs that answered", self.args.leg_timeout_s)
            return await self._finish_legs(planned, legs, bound + wait_s)
        except BaseException:  # this request cancelled (its client went away), or refused: its calls are not needed
            give_up()
            raise

    def _bound(self, short: bool) -> float:
        """How long to wait for a stage: ``leg_timeout_s``, or less (``short``) while it,
        or for the whole graph any stage, is missing."""
        return min(self.args.leg_timeout_s, MISSING_LEG_TIMEOUT_S) if short else self.args.leg_timeout_s

    def _probe(self, name: str, call: "asyncio.Future[Any]") -> bool:
        """Keep a late call to stage ``name`` running (one per stage) while the stage is
        taken for missing: when it answers, however late — Serve routes it to the new
        replica — the stage is back and recalls get their full bound again (a stage back
        but slower than the short bound would otherwise never be waited for). False:
        another probe is out; this call is not needed."""
        probe = self._probes.get(name)
        if probe is not None and not probe.done():
            return False
        self._probes[name] = call
        call.add_done_callback(lambda done: self._probed(name, done))
        return True

    def _probed(self, name: str, call: "asyncio.Future[Any]") -> None:
        if not call.cancelled() and call.exception() is None:
            self._legs_missing.discard(name)

    async def _recall_stepwise(self, query: str, user: str, config: RetrievalConfig,
                               request: dict[str, Any]) -> dict[str, Any]:
        """The graph with every hop awaited here: legs realigned on one generation when a
        swap put them on different ones, and a failed leg, or one that does not answer
        within ``leg_timeout_s``, left out (flagged)."""
        # Only the split graph comes here, and build_app binds all four of its handles.
        assert self.embedder is not None and self.bm25 is not None and self.dense is not None
        try:
            plan = await self._stage("embedder", self.embedder.plan.remote(query, user=user, config=config, **request),
                                     self.args.leg_timeout_s)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake
            return await self._recall_unplanned(query, user, config, request, _failure(exc, self.args.leg_timeout_s))
        legs = await asyncio.gather(self._stage("bm25", self.bm25.search.remote(plan), self.args.leg_timeout_s),
                                    self._stage("dense", self.dense.search.remote(plan), self.args.leg_timeout_s),
                                    return_exceptions=True)
        return await self._finish_legs(plan, legs, self.args.leg_timeout_s)

    async def _recall_unplanned(self, query: str, user: str, config: RetrievalConfig, request: dict[str, Any],
                                failure: str) -> dict[str, Any]:
        """The Embedder gave no plan (``failure``: no answer in time — no live replica,
        Serve is replacing it — or a server error): BM25 alone, on a plan made here
        without a query vector (:meth:`Recaller.plan_without_vector`), flagged. Nothing is
        searched by meaning, but a memory is still found by its words."""
        assert self.bm25 is not None
        if failure.startswith("no answer"):
            self._legs_missing.add("embedder")
        plan = self._vectorless.plan_without_vector(query, user=user, config=config, **request)
        wait_s = self._bound("bm25" in self._legs_missing)
        try:
            lexical = await self._stage("bm25", self.bm25.search.remote(plan), wait_s)
        except Exception as exc:  # noqa: BLE001
            if callers_mistake(exc):
                raise  # the caller's mistake, said by the replica that found it
            raise _unsearchable(f"the embedder failed ({failure}) and the bm25 leg ({_failure(exc, wait_s)})") \
                from None
        note = f"embedder failed ({failure}); answered by BM25 alone, without the query vector"
        return await self._finish_legs(plan, [lexical, None], wait_s, [note])

    async def _finish_legs(self, plan: Any, legs: Sequence[Any], waited_s: float,
                           degraded: Sequence[str] = ()) -> dict[str, Any]:
        """The Ranker over the legs that answered (a failed one is flagged and left out;
        ``None``: not searched)."""
        assert self.bm25 is not None and self.dense is not None and self.ranker is not None
        degraded = [*degraded, *(f"{name} leg failed ({_failure(r, waited_s)}); answered without it"
                                 for name, r in zip(("bm25", "dense"), legs) if isinstance(r, BaseException))]
        lexical, dense = (None if isinstance(r, BaseException) else r for r in legs)
        if lexical is None and dense is None and not plan.skip:
            failed = ", ".join(f"{name} {_failure(r, waited_s)}" for name, r in zip(("bm25", "dense"), legs)
                               if isinstance(r, BaseException))
            raise _unsearchable(f"both retriever legs failed ({failed})")
        if lexical is not None and dense is not None and lexical.generation != dense.generation:
            newer = max(lexical.generation, dense.generation)
            if lexical.generation != newer:
                lexical = await self.bm25.search.remote(plan, newer)
            else:
                dense = await self.dense.search.remote(plan, newer)
            degraded.append(f"legs realigned on generation {newer} during a swap")
        out = await self.ranker.finish.remote(plan, lexical, dense)
        out["flags"].setdefault("degraded", []).extend(degraded)
        return out

    async def _stage(self, name: str, response: Any, wait_s: float, kept: Optional[list[Any]] = None) -> Any:
        """A stage's handle call (its DeploymentResponse) awaited for at most ``wait_s``:
        answered, the stage is not missing; past that it is (:class:`LegTimedOut`), and
        the call is kept as the stage's probe (listed in ``kept``) or cancelled."""
        call = asyncio.ensure_future(response)
        try:
            out = await _settle(call, wait_s)
        except LegTimedOut:
            self._legs_missing.add(name)
            if self._probe(name, call):
                if kept is not None:
                    kept.append(response)
            else:
                call.cancel()
                response.cancel()
            raise
        except Exception:
            self._legs_missing.discard(name)  # it answers, if with an error: not missing
            raise
        self._legs_missing.discard(name)
        return out
