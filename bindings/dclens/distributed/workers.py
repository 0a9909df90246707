"""Model workers on Ray: actors that each hold one loaded model, and the
loop that hands them the items of a run.

The scheduling is Ray's: ray.util.ActorPool gives each idle worker the next
item, and a worker whose process dies is restarted by Ray (its model loaded
again) with the item it was running retried (max_restarts and
max_task_retries of the actor; Cluster.retries). Results go back into input
order. An exception in the user's function is not retried: it ends the run
with a dclens.Error naming the item.

Workers given a Cluster object outlive a call: the Cluster keeps their
handles (Ray ends an actor when its last handle goes), keyed by a digest of
the model reference and the resources, so the next call on the same model
and Cluster finds them loaded and only ships its function. A call on another
model first stops the others, so workers of two models never hold memory
(or GPUs) at once; Cluster.release() stops them, and they end with the
driver's Ray session anyway. With ray="local:N" (a string) a call's workers
end with the call.
"""

from __future__ import annotations

import hashlib
import os
import traceback
from collections.abc import Sequence
from typing import Callable

from .._core import progress as _progress
from .._core.checks import Error
from .._core.reference import ModelRef
from ..model import from_reference
from .cluster import Placement, import_ray


class ModelWorker:
    """The class of the Ray actors: one model, loaded from its reference (on
    a restart, loaded again), and the function of the current call applied to
    each item (fetched from the object store once per call)."""

    def __init__(self, ref: ModelRef):
        self.model = from_reference(ref)
        self.fn_id: str | None = None
        self.fn: Callable | None = None

    def ready(self) -> int:
        return os.getpid()

    def run(self, fn_box: list, index: int, item):
        """(index, True, fn(model, item)) or (index, False, the exception and
        its traceback). fn_box: [ObjectRef of fn] (boxed: Ray passes it
        unresolved, so fn is deserialised once per call, not per item)."""
        import ray  # optional: the distributed extra

        try:
            if self.fn_id != fn_box[0].hex():
                self.fn, self.fn_id = ray.get(fn_box[0]), fn_box[0].hex()
            assert self.fn is not None
            return index, True, self.fn(self.model, item)
        except Exception as e:  # noqa: BLE001 -- handed to the driver, which names the item
            return index, False, "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc())


def describe(item, width: int = 80) -> str:
    """A short repr of an item for error messages."""
    try:
        r = repr(item)
    except Exception:  # noqa: BLE001 -- any object may be an item
        r = "<%s>" % type(item).__name__
    return r if len(r) <= width else r[: width - 3] + "..."


def item_error(index: int, n: int, item, what: str) -> Error:
    return Error("item %d of %d (%s) failed: %s" % (index, n, describe(item), what.rstrip()))


def progress_bar(total: int, progress: bool | None, desc: str, unit: str):
    """The package's progress bar (dclens.progress: tqdm.auto where someone
    watches, a few plain lines in a log, nothing with progress=False)."""
    return _progress.bar(total=total, desc=desc, progress=progress, unit=unit)


def _ray_message(e: BaseException, limit: int = 2000) -> str:
    s = str(e).strip()
    return s if len(s) <= limit else "..." + s[-limit:]


def _stop(workers: list) -> None:
    ray = import_ray()
    for w in workers:
        ray.kill(w)
    workers.clear()


def _key(ref: ModelRef, placement: Placement) -> str:
    what = repr((ref, placement.num_cpus, placement.num_gpus, placement.retries))
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def run(
    ref: ModelRef,
    fn: Callable,
    items: Sequence,
    placement: Placement,
    progress: bool | None,
    desc: str,
    unit: str = "item",
    kept: dict[str, list] | None = None,
) -> list:
    """fn(model, item) for every item on placement.workers actors; the
    results in the order of items. kept: a Cluster's workers by key (those
    of this model are reused, the others stopped); None: the workers are
    started for this call and stopped at its end."""
    ray = import_ray()
    from ray.exceptions import RayError  # optional: the distributed extra
    from ray.util import ActorPool  # optional: the distributed extra

    n = len(items)
    if n == 0:
        return []
    key, count = _key(ref, placement), min(placement.workers, n)
    if kept is None:
        started: list = []
    else:
        for other in [k for k in kept if k != key]:
            _stop(kept.pop(other))
        started = kept.setdefault(key, [])
    actor = ray.remote(ModelWorker).options(
        num_cpus=placement.num_cpus,
        num_gpus=placement.num_gpus,
        max_restarts=placement.retries,
        max_task_retries=placement.retries,
    )
    while len(started) < count:
        started.append(actor.remote(ref))
    workers = started[:count]
    try:
        ray.get([w.ready.remote() for w in workers])
    except RayError as e:
        _stop(started)
        raise Error("a worker could not start (load the model %s): %s" % (ref.source, _ray_message(e))) from None
    fn_box = [ray.put(fn)]
    out: list = [None] * n
    bar = progress_bar(n, progress, "%s (%d workers)" % (desc, len(workers)), unit)
    try:
        pool = ActorPool(workers)
        for i, item in enumerate(items):
            pool.submit(lambda w, job: w.run.remote(fn_box, *job), (i, item))
        while pool.has_next():
            try:
                i, ok, value = pool.get_next_unordered()
            except RayError as e:
                _stop(started)
                raise Error(
                    "a worker running %s died more than %d times (Cluster.retries), cannot be "
                    "reached, or cannot unpickle the function: %s" % (desc, placement.retries, _ray_message(e))
                ) from None
            if not ok:
                raise item_error(i, n, items[i], value)
            out[i] = value
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if kept is None:
            _stop(started)
    return out
