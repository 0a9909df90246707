"""The synthetic benchmark on a Ray cluster: ``dclens synth --ray local:N |
ADDRESS`` and ``dclens.distributed.synth(models, data, ray=...)`` (this
function, found through the dclens.distributed entry point group).

This process tokenizes and batches the lines exactly as evaluate() does
(evaluate.plan, with the model directory's tokenizer.json, no model loaded
here); each batch is one work item, scored on a worker by evaluate.score_batch
(the same forward pass as in one process); evaluate.finish puts the answers
back in file order. So answers and summary equal those of a single-process
run whose model has the workers' thread count, to the bit; only `speed`
differs (it adds the number of workers and their threads each).

The workers load each model again from its files: hooks in force on a
dclens.Model given here (``with model.hooks(...)``, ``model.add_hook``) are
not theirs, so such a call raises a dclens.Error naming those hooks rather
than scoring the un-hooked model (evaluate() in this process runs them).
"""

from __future__ import annotations

import os

from .dataset import Dataset, load_dataset
from .evaluate import EvalResult, finish, plan, refuse_hooks, score_batch


def synth(
    models,
    data,
    *,
    ray,
    device: str = "cpu",
    dtype: str = "auto",
    batch_tokens: int | None = None,
    max_batch: int = 64,
    tokenizer=None,
    progress: bool | None = None,
    tasks=None,
) -> list[EvalResult]:
    """One EvalResult per model (a path, bundled name, dclens.Model or
    ModelRef; or a list of them), run over the Ray workers ``ray`` names
    ("local:N", "auto", an address or a dclens.distributed.Cluster).
    data: a benchmark JSONL path, a Dataset or a list of Line. batch_tokens:
    padded tokens per batch (default 1024 on cpu, 4096 on cuda, as the
    command line). dtype: load's dtype= for paths and names. tokenizer: for
    model directories without tokenizer.json.
    A model with hooks in force: a dclens.Error (the workers cannot run them)."""
    specs = list(models) if isinstance(models, (list, tuple)) else [models]
    for spec in specs:  # before anything starts
        refuse_hooks(
            spec,
            "synth_tasks.distributed.synth (ray=%r)" % (ray,),
            "the Ray workers load the model again from its files, without them, and would score the "
            "un-hooked model. Run synth_tasks.evaluate(model, lines) in this process to score the hooked model",
        )
    from dclens import distributed
    from dclens.model import load_tokenizer

    ds = load_dataset(data) if isinstance(data, (str, os.PathLike)) else data
    lines = ds.lines if isinstance(ds, Dataset) else list(ds)
    bt = batch_tokens or (4096 if device == "cuda" else 1024)
    out = []
    for spec in specs:
        ref = distributed.model_ref(spec, device, dtype)
        directory = ref.directory()
        tok = tokenizer if tokenizer is not None else load_tokenizer(directory)
        name = os.path.basename(os.path.normpath(directory))
        p = plan(lines, tok, bt, max_batch)
        items = [[p.toks[i] for i in batch] for batch in p.batches]
        placement = distributed.connect(ray, ref.device, ref.n_threads)
        scored = distributed.map(
            ref, score_batch, items, ray=ray, progress=progress, desc=f"synth {name}", unit="batch"
        )
        out.append(
            finish(
                p,
                scored,
                name,
                tasks,
                speed_extra={"workers": min(placement.workers, len(items)), "n_threads": placement.n_threads},
            )
        )
    return out
