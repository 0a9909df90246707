"""dclens.distributed: the benchmark, patching sweeps and your own
per-prompt functions spread over workers of a Ray cluster, each worker
holding one loaded model (docs/distributed.md).

    from dclens import distributed as dd
    dd.map("path/to/DCPythia-6.9B", fn, prompts, ray="local:4")   # fn(model, item), in order
    dd.synth(["DCPythia-6.9B", "pythia-6.9b"], data, ray="auto")  # the 74-task benchmark
    patching.sweep(model, clean, corrupted, metric, ray="local:2")

Ray is an optional dependency (pip install 'dclens[distributed]'); import
dclens never imports it. Work items are sharded across the workers by Ray
(ray.util.ActorPool), results come back in input order and are the same, to
the bit, as a single-process run of the same items; a worker that dies is
restarted by Ray and its item run again. (To the bit whatever the workers'
n_threads: the engine cuts its products by shape, not by thread count.) Models
travel as references
(dclens.reference): each worker loads the model from the same files, checked
against the fingerprint taken where the run started. Workers of a Cluster
object stay up after a call, their model loaded, for its next call on the
same model; a call on another model replaces them; Cluster.release() stops
them (with ray="local:N", a string, they end with each call).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Union

import numpy as np

from .._core import plugins
from .._core.bundled import resolve
from .._core.checks import Error
from .._core.reference import ModelRef, fingerprint
from ..model import Model, from_reference, weight_dtype_arg
from .cluster import Cluster, Placement, connect
from .workers import item_error, progress_bar, run

__all__ = ["Cluster", "Placement", "connect", "map", "model_ref", "run_cells", "synth"]

ModelSpec = Union[Model, ModelRef, str, os.PathLike]
RaySpec = Union[None, str, Cluster]
DISTRIBUTED = "dclens.distributed"  # entry point group: synth comes from synth_tasks


def model_ref(model: ModelSpec, device: str = "cpu", dtype: str = "auto") -> ModelRef:
    """The reference workers load a model from.

    Parameters
    ----------
    model : dclens.Model or ModelRef or str or os.PathLike
        A Model (its own reference: its load arguments and the fingerprint of its files at
        load), a ModelRef (as it is), or a path or bundled name (one made now, its files
        fingerprinted now).
    device : {"cpu", "cuda"}
        The device of a reference made from a path or name.
    dtype : {"auto", "float32", "float16", "bfloat16"}
        load's dtype= for a reference made from a path or name.

    Returns
    -------
    dclens.reference.ModelRef
        The reference.

    Raises
    ------
    dclens.Error
        A model of another type, an unknown device, a path that is no model directory (no
        config.json), or a name that is neither a path nor a bundled model
        (NotFoundError).
    """
    if isinstance(model, Model):
        return model.reference()
    if isinstance(model, ModelRef):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise Error(
            "model must be a dclens.Model, a path, a bundled model name or a ModelRef, not %s %r"
            % (type(model).__name__, model)
        )
    if device not in ("cpu", "cuda"):
        raise Error("device must be 'cpu' or 'cuda', not %r" % (device,))

    dtype = weight_dtype_arg(dtype)
    directory = os.fsdecode(resolve(model))
    source = model if isinstance(model, str) and not os.path.lexists(model) else os.path.abspath(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise Error("%s: not a model directory (no config.json)" % directory)
    return ModelRef(source=source, device=device, files=fingerprint(directory), dtype=dtype)


def map(
    model: ModelSpec,
    fn: Callable[[Model, Any], Any],
    items: Iterable,
    *,
    ray: RaySpec = None,
    device: str = "cpu",
    progress: bool | None = None,
    desc: str = "dclens.distributed.map",
    unit: str = "item",
) -> list:
    """[fn(model, item) for item in items], run on workers that each hold the model.

    model: a loaded Model (travels as its reference), a path or bundled name
    (with device=), or a ModelRef. fn: any function Ray can serialise
    (cloudpickle: closures and lambdas too); an exception it raises ends the
    run with a dclens.Error naming the item (index, repr) and the remote
    traceback. ray: "local:N", "auto", an address or a Cluster (see
    dclens.distributed.cluster); None runs everything in this process (the
    reference the distributed results equal, to the bit).
    Workers run n_threads CPU threads each (Cluster.n_threads, else the
    model's own), or one GPU each for device="cuda". The model's hooks in force travel
    with the work and apply around each item.

    Parameters
    ----------
    model : dclens.Model or ModelRef or str or os.PathLike
        A loaded Model (travels as its reference), a path or bundled name (with device=),
        or a ModelRef.
    fn : callable
        fn(model, item).
    items : iterable
        The work items.
    ray : str or Cluster or None
        "local:N", "auto", an address or a Cluster; None runs everything in this process.
    device : {"cpu", "cuda"}
        The workers' device, for a model given by path or name.
    progress : bool or None
        A progress bar over the items (dclens.progress).
    desc : str
        The bar's label.
    unit : str
        The bar's unit.

    Returns
    -------
    list
        fn(model, item) for each item, in input order.

    Raises
    ------
    dclens.Error
        fn not callable, a bad model or ray= argument (model_ref, connect), or an item whose
        fn raised (naming the item, its index and the remote traceback).
    """
    if not callable(fn):
        raise Error("fn must be a function fn(model, item), not %r" % (fn,))
    items = list(items)
    ref = model_ref(model, device)
    if ray is None:
        return _run_here(model, ref, fn, items, progress, desc, unit)
    hooks = model.hooks_in_force() if isinstance(model, Model) else []
    if hooks:
        # the hooks in force travel with the work (a worker's model is loaded
        # again from the reference, without them) and apply around each item
        fn = functools.partial(_with_hooks, hooks, fn)
    placement = connect(ray, ref.device, ref.n_threads)
    if ref.device == "cpu":
        ref = ref.with_threads(placement.n_threads)
    return run(ref, fn, items, placement, progress, desc, unit, ray.kept if isinstance(ray, Cluster) else None)


def _with_hooks(hooks: list, fn: Callable, model: Model, item):
    """fn(model, item) with the caller's hooks in force (map's hooks on workers)."""
    with model.hooks(hooks):
        return fn(model, item)


def _run_here(model: ModelSpec, ref: ModelRef, fn: Callable, items: list, progress, desc: str, unit: str) -> list:
    m = model if isinstance(model, Model) else from_reference(ref)
    out = []
    bar = progress_bar(len(items), progress, desc, unit)
    try:
        for i, item in enumerate(items):
            try:
                out.append(fn(m, item))
            except Exception as e:  # noqa: BLE001 -- named with its item, as on the workers
                raise item_error(i, len(items), item, "%s: %s" % (type(e).__name__, e)) from e
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out


def synth(models: ModelSpec | Sequence[ModelSpec], data, *, ray: RaySpec, **kw):
    """The 74-task synthetic benchmark of each model, its batches spread over
    the workers: a list of synth_tasks EvalResult, equal (answers, summary)
    to single-process runs. Comes from synth_tasks (entry point group
    dclens.distributed), which must be installed; keywords: see
    synth_tasks.distributed.synth.

    Parameters
    ----------
    models : model or sequence of models
        Each a dclens.Model, a ModelRef, a path or a bundled name.
    data : str or dataset
        The benchmark's lines (a JSONL path or a loaded dataset; synth_tasks.load_dataset).
    ray : str or Cluster or None
        "local:N", "auto", an address or a Cluster; None runs everything in this process.
    **kw
        synth_tasks.distributed.synth's keywords.

    Returns
    -------
    list of synth_tasks.EvalResult
        One per model, in order.

    Raises
    ------
    dclens.Error
        synth_tasks is not installed (no dclens.distributed entry point named synth), or
        the run fails.
    """
    return plugins.find(DISTRIBUTED, "synth")(models, data, ray=ray, **kw)


def _cells_values(
    run_cells_here: Callable, corrupted: np.ndarray, clean: dict, metric, model: Model, chunk
) -> np.ndarray:
    """What one batch of a patching sweep gives: patching._run_cells of
    exactly those cells, the same forward pass as in a single process."""
    return run_cells_here(model, corrupted, chunk, clean, metric, len(chunk), False, "")


def run_cells(
    model: Model,
    corrupted: np.ndarray,
    cells: list,
    clean_cache,
    metric,
    batch_size: int,
    progress,
    desc: str,
    ray: RaySpec,
    run_cells_here: Callable,
) -> np.ndarray:
    """patching.sweep(..., ray=...): run_cells_here (patching._run_cells) on
    Ray workers, over the cells in the same batches of batch_size as in one
    process, one batch per item; the clean activations the cells read travel
    once per worker.

    Parameters
    ----------
    model : dclens.Model
        The model.
    corrupted : numpy.ndarray
        [T] token ids of the corrupted prompt (the run each cell patches).
    cells : list
        The sweep's cells, each a list of (hook name, apply(act_row, clean_act)) pairs.
    clean_cache : dclens.Cache
        The clean run's activations (only the hooks the cells name travel).
    metric : callable
        The sweep's metric of the patched logits.
    batch_size : int
        Cells per forward pass (and per work item).
    progress : bool or None
        A progress bar over the batches.
    desc : str
        The bar's label.
    ray : str or Cluster or None
        "local:N", "auto", an address or a Cluster; None runs everything in this process.
    run_cells_here : callable
        patching._run_cells, which computes one batch's values.

    Returns
    -------
    numpy.ndarray
        One metric value per cell, in order.

    Raises
    ------
    dclens.Error
        As map: a bad ray= argument, or a batch that failed on its worker.
    """
    chunks = [cells[i : i + batch_size] for i in range(0, len(cells), batch_size)]
    names = sorted({name for chunk in chunks for patches in chunk for name, _ in patches})
    clean = {n: clean_cache[n] for n in names}
    fn = functools.partial(_cells_values, run_cells_here, np.ascontiguousarray(corrupted), clean, metric)
    parts = map(model, fn, chunks, ray=ray, progress=progress, desc=desc, unit="batch")
    return np.concatenate(parts) if parts else np.empty(0)
