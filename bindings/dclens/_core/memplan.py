"""The gradient tape's memory plan seen from Python: the estimate before
anything is allocated, the budget, and how many integrated-gradients steps
one batch may hold.

The engine (dcs_tape_plan) counts the tape's buffers under both plans:
``full`` keeps every layer's activations; ``recompute`` keeps each layer's
input (a checkpoint of the residual stream) and one layer's internals, and
recomputes a layer from its checkpoint before its backward (the same
results, bit for bit, for about one more forward pass of time). A tape takes
the full plan when it fits in ``max_tape_bytes`` and recomputes otherwise.

The default budget is half of the memory the model's activations live in
that is free when the tape is made, counting the idle tapes the model keeps
(tapes.TapeCache) as free: for a CPU model the memory the kernel reports
available (MemAvailable); for a CUDA model the GPU's free memory
(cudaMemGetInfo, plus what the backend's pool holds unused: dcs_device_memory),
falling back to the host's when the device cannot say. The weights stay in
their stored dtype and are not counted here (they are already resident or
mapped).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .checks import Error


def available_memory() -> int:
    """The host memory available now.

    Returns
    -------
    int
        Bytes: /proc/meminfo's MemAvailable, else the physical memory (sysconf), else 2**62
        where neither can be read.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def device_memory(model) -> int | None:
    """The free memory of the model's device.

    Parameters
    ----------
    model : dclens.Model or None
        The model.

    Returns
    -------
    int or None
        Free bytes of its GPU (dcs_device_memory: cudaMemGetInfo plus what the backend's pool
        holds unused); None for no model, a CPU model, or a device that cannot say.
    """
    if model is None or getattr(model.runner, "device", "cpu") == "cpu":
        return None
    return model.runner.device_memory()


def default_budget(model=None) -> int:
    """The default tape budget: half of the free memory where the model's tape would live.

    Parameters
    ----------
    model : dclens.Model or None
        The model: its device's free memory (device_memory), else the host's
        (available_memory), plus the bytes its idle tapes hold.

    Returns
    -------
    int
        Bytes, at least 256 MiB.
    """
    free = device_memory(model)
    if free is None:
        free = available_memory()
    idle = model.runner.tapes.held_bytes() if model is not None else 0
    return max(256 << 20, (free + idle) // 2)


def check_budget(max_tape_bytes: int | None, model=None) -> int:
    """A max_tape_bytes argument as the budget in bytes.

    Parameters
    ----------
    max_tape_bytes : int or None
        A positive number of bytes, or None for default_budget(model).
    model : dclens.Model or None
        The model whose device the default is for.

    Returns
    -------
    int
        The budget, bytes.

    Raises
    ------
    dclens.Error
        `max_tape_bytes` is not None or a positive integer.
    """
    if max_tape_bytes is None:
        return default_budget(model)
    if isinstance(max_tape_bytes, bool) or not isinstance(max_tape_bytes, int) or max_tape_bytes < 1:
        raise Error("max_tape_bytes must be a positive integer (bytes) or None, not %r" % (max_tape_bytes,))
    return int(max_tape_bytes)


def tape_bytes(model, B: int, T: int, recompute: bool, points: Sequence[int] = (), first: int = 0) -> int:
    """The engine's estimate of a tape's buffers under one plan (dcs_tape_plan).

    Parameters
    ----------
    model : dclens.Model
        The model.
    B : int
        Sequences in the batch.
    T : int
        Tokens per sequence.
    recompute : bool
        The recompute plan (keep each layer's input only) rather than the full one.
    points : sequence of int
        Engine hook point ids whose gradients the backward hands out.
    first : int
        The first layer the tape runs (IG at a later layer starts there).

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    dclens.Error
        The engine refuses the plan (sizes out of range).
    """
    return model.runner.tape_plan(B, T, first, recompute, points)


def param_table(model) -> list[tuple[str, int, int, bool]]:
    """Every parameter of the model in the engine's flat layout (dcs_param_info).

    Parameters
    ----------
    model : dclens.Model
        The model whose parameters are listed.

    Returns
    -------
    list of tuple
        (canonical name, offset, number of elements, weight-decayed) per parameter, in the
        layout's order; the names are Model.weight's.
    """
    return model.runner.param_table()


def estimate(
    model, T: int, B: int = 1, wrt: Sequence[str] = (), max_tape_bytes: int | None = None
) -> dict[str, object]:
    """The memory of a gradient pass under both tape plans, before anything is allocated.

    Model.estimate_backward_memory calls this. A parameter counts its float32 gradient (and
    on CUDA its device mirror, held through the backward).

    Parameters
    ----------
    model : dclens.Model
        The model.
    T : int
        Tokens per sequence (>= 1).
    B : int
        Sequences (>= 1).
    wrt : str or sequence of str
        The hook names and parameter names the gradients are asked at.
    max_tape_bytes : int or None
        The budget, bytes (None: default_budget(model)).

    Returns
    -------
    dict
        "full" and "recompute": bytes of each plan; "budget": the budget in bytes; "plan":
        the plan the budget picks, "full", "recompute", or None when neither fits.

    Raises
    ------
    dclens.Error
        T or B not a positive integer, an unknown hook name (UnknownNameError), or a bad
        budget.
    """
    if isinstance(wrt, str):
        wrt = [wrt]
    for name, v in (("T", T), ("B", B)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise Error("estimate_backward_memory: %s must be a positive integer, not %r" % (name, v))
    sizes = {r[0]: r[2] for r in param_table(model)}
    pts = [model.parse_hook(n)[0] for n in wrt if not (isinstance(n, str) and n in sizes)]
    params = sum(sizes[n] for n in set(wrt) if isinstance(n, str) and n in sizes)
    params *= 4 * (2 if getattr(model.runner, "device", "cpu") == "cuda" else 1)
    budget = check_budget(max_tape_bytes, model)
    full = tape_bytes(model, B, T, False, pts) + params
    rc = tape_bytes(model, B, T, True, pts) + params
    plan = "full" if full <= budget else "recompute" if rc <= budget else None
    return {"full": full, "recompute": rc, "budget": budget, "plan": plan}


def hook_bytes(model, point: int, B: int, T: int) -> int:
    """The size of one activation at a hook point.

    Parameters
    ----------
    model : dclens.Model
        The model.
    point : int
        The engine's hook point id.
    B : int
        Sequences.
    T : int
        Tokens per sequence.

    Returns
    -------
    int
        Bytes of the float32 activation for B x T tokens.
    """
    n = 4
    for d in model.runner.hook_shape(point, B, T):
        n *= d
    return n


def ig_extra(model, T: int, k: int, point: int) -> int:
    """What an integrated-gradients batch holds besides its tape's own buffers (ig_batch).

    The interpolated activations and their gradients (2 per point), the activation,
    baseline, difference, first gradient and two float64 sums (8 of one point), the logits
    and their gradient.

    Parameters
    ----------
    model : dclens.Model
        The model (its vocabulary sizes the logits).
    T : int
        Tokens per sequence.
    k : int
        Interpolation points in the batch.
    point : int
        The engine's hook point id attributed to.

    Returns
    -------
    int
        Bytes.
    """
    return 2 * hook_bytes(model, point, k, T) + 8 * hook_bytes(model, point, 1, T) + 8 * k * T * model.config.vocab


def ig_batch(model, T: int, steps: int, point: int, budget: int, first: int = 0) -> tuple[int, bool]:
    """How many IG interpolation points one tape holds under the budget, and
    whether it recomputes: the most that fit keeping every layer, else the
    most that fit with recomputation (at least 1; the tape itself refuses
    when even that does not fit). Counted with the tape (its buffers, the
    interpolated activations and their gradients): what attribution.py holds
    besides, the activation, its baseline and difference, its first
    gradient, two float64 sums, and the batch's logits with their gradient.

    Parameters
    ----------
    model : dclens.Model
        The model whose tape is planned.
    T : int
        Tokens per sequence.
    steps : int
        The interpolation points wanted (the most one batch needs).
    point : int
        The engine's hook point id attributed to.
    budget : int
        The memory budget, bytes.
    first : int
        The first layer the tape runs.

    Returns
    -------
    k : int
        Interpolation points per batch, in [1, steps].
    recompute : bool
        Whether the tape needs the recompute plan for that.
    """

    def most(recompute: bool) -> int:
        lo, hi = 0, steps
        while lo < hi:  # largest k <= steps that fits
            k = (lo + hi + 1) // 2
            if tape_bytes(model, k, T, recompute, (), first) + ig_extra(model, T, k, point) <= budget:
                lo = k
            else:
                hi = k - 1
        return lo

    k = most(False)
    if k:
        return k, False
    return max(1, most(True)), True
