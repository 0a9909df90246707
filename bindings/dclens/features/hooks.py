"""Features as hooks: dictionaries spliced into a pass through the model's write hooks, their
activations in the cache (``<hook>.sae.acts``), and write hooks on those activations to ablate,
steer or patch a feature (docs/features.md, "Features as hooks").

    logits, cache = features.run_with_saes(model, toks, [sae], use_error_term=True)
    cache["blocks.1.resid_pre.sae.acts"]                      # [B, T, d_sae]
    features.run_with_saes(model, toks, [sae], fwd_hooks=features.ablate_features(sae, [3, 7]))
    with model.hooks(features.sae_hooks(model, [sae], fwd_hooks=features.steer(sae, 5, 4.0))):
        model.generate(...)

An SAE on hook H replaces H's activation x by its reconstruction (plus the error
x - recon with use_error_term, so the pass is the plain one until a feature is edited); a
transcoder replaces its output hook's activation by its output from its input hook's activation
of the same pass. Feature hooks are named after the dictionary's (input) hook:
``<cfg.hook_name>.sae.acts``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._core.checks import ArgumentError, Error, check_bool, check_int_list, is_finite_number
from .._core.hooks import HookPoint, Hooks, _validate, flatten_hooks, is_read_only, read_only
from .._core.names import canonical
from .sae import SAE, check_fits

SUFFIXES = ("acts", "recon", "error", "input")  # the cache entries <hook>.sae.<suffix>
ACTS = ".sae.acts"


def feature_hook_name(sae: SAE, what: str = "acts") -> str:
    """The name of a dictionary's entry in a run_with_saes cache / its feature hook.

    Parameters
    ----------
    sae : SAE
        The dictionary.
    what : {"acts", "recon", "error", "input"}
        Feature activations [..., d_sae], the reconstruction and the error [..., d_out] (at the
        output hook for a transcoder), or the activation the dictionary read [..., d_in].

    Returns
    -------
    str
        ``<cfg.hook_name>.sae.<what>`` (dclens spelling).

    Raises
    ------
    dclens.Error
        Not an SAE, an SAE without hook_name, or an unknown `what`.
    """
    _check_sae("sae", sae)
    if what not in SUFFIXES:
        raise ArgumentError("what must be one of %s, not %r" % (", ".join(SUFFIXES), what))
    return "%s.sae.%s" % (sae.cfg.hook_name, what)


def _check_sae(what: str, sae) -> SAE:
    if not isinstance(sae, SAE):
        raise Error("%s must be a dclens.features.SAE, not %s" % (what, type(sae).__name__))
    if sae._e.closed:
        raise Error("%s is closed (close() freed its engine memory)" % what)
    if not sae.cfg.hook_name:
        raise Error("%s.cfg.hook_name is empty: which hook does it read?" % what)
    return sae


def _saes_arg(model, saes) -> list[SAE]:
    """saes as a checked list: each an open SAE that fits the model, at most one per hook."""
    lst = [saes] if isinstance(saes, SAE) else saes
    if not isinstance(lst, (list, tuple)) or not lst:
        raise Error("saes must be an SAE or a non-empty list of them, not %r" % (saes,))
    seen: dict[str, int] = {}
    for i, s in enumerate(lst):
        what = "saes[%d]" % i
        _check_sae(what, s)
        try:
            check_fits(model, s)
        except Error as e:
            raise Error("%s does not fit the model: %s" % (what, e)) from None
        for h in (s.cfg.hook_name_out or s.cfg.hook_name, s.cfg.hook_name):
            if h in seen and seen[h] != i:
                raise Error("saes[%d] and %s both use hook %s: one dictionary per hook" % (seen[h], what, h))
            seen[h] = i
    return list(lst)


def _split_hooks(fwd_hooks, saes: list[SAE]) -> tuple[list, dict[str, list]]:
    """fwd_hooks as (the model's hooks, {acts name: [fn, ...]} of the feature hooks)."""
    model_hooks: list = []
    feats: dict[str, list] = {feature_hook_name(s): [] for s in saes}
    for n, fn in flatten_hooks(fwd_hooks):
        if isinstance(n, str) and ".sae." in n:
            key = canonical(n.split(".sae.", 1)[0]) + ".sae." + n.split(".sae.", 1)[1]
            if key not in feats:
                known = ", ".join(feats)
                raise Error(
                    "fwd_hooks: %s is no feature hook of these dictionaries (write hooks go on %s)" % (n, known)
                )
            feats[key].append(fn)
        else:
            model_hooks.append((n, fn))
    return model_hooks, feats


def _rows(sae: SAE, a: np.ndarray, width: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """a [..., per-position dims] as rows [N, width] and its leading (batch, position) shape."""
    n, k = 1, a.ndim
    while k > 0 and n < width:
        k -= 1
        n *= a.shape[k]
    if n != width:
        raise Error("hook %s: activation of shape %s has no trailing width %d" % (sae.cfg.hook_name, a.shape, width))
    return np.ascontiguousarray(a, np.float32).reshape(-1, width), a.shape[:k]


def _feature_edit(fns: list, acts: np.ndarray, name: str) -> np.ndarray:
    """Run the feature hooks fn(acts, name) on a copy of acts; the edited activations."""
    work = acts.copy()
    hp = HookPoint(name)
    for fn in fns:
        if is_read_only(fn):
            seen = work.view()
            seen.flags.writeable = False
            if fn(seen, hp) is not None:
                raise Error("hook %s: %r is read-only but returned an array" % (name, getattr(fn, "fn", fn)))
            continue
        out = fn(work, hp)
        if out is not None and out is not work:
            work[...] = _validate(out, work.shape, name)
    if not np.isfinite(work).all():
        raise Error("hook %s: the hook function wrote NaN or inf values" % name)
    return work


def _splice_fn(sae: SAE, fns: list, use_error_term: bool, store: dict | None, fed: dict):
    """The write hook at the dictionary's (output) hook."""
    c = sae.cfg
    w_dec = sae._e.get("param", sae._e.names.index("W_dec")).reshape(c.d_sae, c.width_out)
    b_dec = sae._e.get("param", sae._e.names.index("b_dec"))  # the decoder as it is now
    acts_name = feature_hook_name(sae)

    def splice(act, name):
        a = np.asarray(act)
        if c.is_transcoder:
            if "x" not in fed:
                raise Error(
                    "transcoder %s -> %s: its input hook did not run before its output hook in this pass"
                    % (c.hook_name, c.hook_name_out)
                )
            x, lead = fed.pop("x")
        else:
            x, lead = _rows(sae, np.array(a, np.float32), c.d_in)  # a copy: the pass writes into a
        y, lead_out = _rows(sae, a, c.width_out)
        if lead != lead_out:
            raise Error("transcoder %s: input positions %s differ from output's %s" % (c.hook_name, lead, lead_out))
        acts = sae.encode(x)
        recon = (acts @ w_dec + b_dec).astype(np.float32)  # [N, d_out], as SAE.decode
        error = y - recon
        edited = _feature_edit(fns, acts.reshape(lead + (c.d_sae,)), acts_name).reshape(acts.shape) if fns else acts
        changed = edited is not acts and not np.array_equal(edited, acts)
        if changed:
            recon = (edited @ w_dec + b_dec).astype(np.float32)
        if store is not None:
            for what, v in (("acts", edited), ("recon", recon), ("error", error), ("input", x)):
                v = v.reshape(lead + (v.shape[-1],))
                store[feature_hook_name(sae, what)] = v
        if use_error_term and not changed:
            return None  # recon + (y - recon): y itself, bit for bit
        out = recon + error if use_error_term else recon
        return out.reshape(a.shape)

    splice.__name__ = "splice_%s" % ("transcoder" if c.is_transcoder else "sae")
    return splice


def _keep_input(sae: SAE, fed: dict):
    def keep_input(act, name):
        fed["x"] = _rows(sae, np.array(act, np.float32), sae.cfg.d_in)

    return keep_input


def sae_hooks(model, saes, *, fwd_hooks=(), use_error_term: bool = False, store: dict | None = None) -> Hooks:
    """The model hooks that splice dictionaries into every pass they are given to.

    Give them to run_with_hooks / run_with_cache, ``with model.hooks(...)`` or add_hook:
    ``with model.hooks(sae_hooks(model, [sae], fwd_hooks=steer(sae, 3, 5.0))): model.generate(p)``.
    They hold a copy of each decoder as it is when they are made: make them again after
    training the dictionary further (run_with_saes makes its own on every call).

    Parameters
    ----------
    model : dclens.Model
        The model (the dictionaries are checked against it).
    saes : SAE or list of SAE
        The dictionaries, at most one per hook; each SAE replaces its hook's activation by
        its reconstruction, each transcoder its output hook's by its output.
    fwd_hooks : sequence of (str, callable) or Hooks
        Feature hooks only: (``<hook>.sae.acts``, fn(acts, name) -> acts or None), as
        ablate_features / steer / patch_features make.
    use_error_term : bool
        Add the error (activation - reconstruction) back: the pass is the plain pass
        (bit for bit) until a feature hook edits an activation.
    store : dict or None
        Receives ``<hook>.sae.acts`` / ``.recon`` / ``.error`` / ``.input`` of each pass.

    Returns
    -------
    Hooks
        The (name, fn) pairs: for a transcoder a read-only hook at its input hook and a write
        hook at its output hook; for an SAE a write hook at its hook.

    Raises
    ------
    dclens.Error
        saes not SAEs, one whose hook or width does not fit the model (naming saes[i]), two
        on one hook, fwd_hooks that are not feature hooks of these dictionaries.
    """
    lst = _saes_arg(model, saes)
    check_bool("use_error_term", use_error_term)
    model_hooks, feats = _split_hooks(fwd_hooks, lst)
    if model_hooks:
        raise Error(
            "fwd_hooks: %s is not a feature hook (<hook>.sae.acts); give the model's hooks to the pass itself"
            % (model_hooks[0][0],)
        )
    pairs: list = []
    for s in lst:
        fed: dict = {}
        if s.cfg.is_transcoder:
            pairs.append((s.cfg.hook_name, read_only(_keep_input(s, fed))))
        target = s.cfg.hook_name_out or s.cfg.hook_name
        pairs.append((target, _splice_fn(s, feats[feature_hook_name(s)], use_error_term, store, fed)))
    return Hooks(pairs)


def run_with_saes(
    model,
    tokens,
    saes,
    *,
    fwd_hooks=(),
    use_error_term: bool = False,
    names=None,
    return_type: str | None = "logits",
    **kw,
):
    """A pass with dictionaries spliced in at their hooks, and its cache with their features.

    Parameters
    ----------
    model : dclens.Model
        The model.
    tokens : str or list of str or array_like of int
        As for Model.run_with_cache.
    saes : SAE or list of SAE
        The dictionaries, as for sae_hooks.
    fwd_hooks : sequence of (str, callable) or Hooks
        The model's hooks (run before the splices at a shared hook) and feature hooks on
        ``<hook>.sae.acts`` (fn(acts, name) -> acts or None).
    use_error_term : bool
        Add each dictionary's error back (the plain pass until a feature is edited).
    names : str or sequence of str or callable or None
        The model's activations to capture, as run_with_cache's names (None: every hook);
        ``<hook>.sae.*`` names are always in the cache.
    return_type : {"logits", "loss", "both", None}
        As for Model.forward.
    **kw
        Other run_with_cache arguments (lengths, padding_side, prepend_bos).

    Returns
    -------
    tuple
        (logits, cache): the cache holds the model's activations (a dictionary's hook holds
        what the pass read on from there: the spliced activation) and, per dictionary,
        ``<hook>.sae.acts`` [..., d_sae] (after the feature hooks), ``.recon`` and ``.error``
        [..., d_out] (error = activation - reconstruction of the unedited features) and
        ``.input`` [..., d_in].

    Raises
    ------
    dclens.Error
        As for sae_hooks, a model hook name the model lacks, or what run_with_cache refuses.
    """
    lst = _saes_arg(model, saes)
    model_hooks, feats = _split_hooks(fwd_hooks, lst)
    feat_hooks = [(n, fn) for n, fns in feats.items() for fn in fns]
    if isinstance(names, str):
        names = [names]
    if isinstance(names, Sequence):
        bad = [n for n in names if isinstance(n, str) and ".sae." in n and n.rsplit(".", 1)[-1] not in SUFFIXES]
        if bad:
            raise Error("names: %s is no run_with_saes cache entry (<hook>.sae.%s)" % (bad[0], "|".join(SUFFIXES)))
        names = [n for n in names if not (isinstance(n, str) and ".sae." in n)]
    store: dict = {}
    hooks = Hooks(model_hooks) + sae_hooks(model, lst, fwd_hooks=feat_hooks, use_error_term=use_error_term, store=store)
    out, cache = model.run_with_cache(tokens, names=names, fwd_hooks=hooks, return_type=return_type, **kw)
    for k, v in store.items():
        dict.__setitem__(cache, k, v)
    return out, cache


# ---------------------------------------------------------------- feature hooks


def _features_arg(sae: SAE, what: str, value) -> list[int]:
    v = [value] if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    return check_int_list(what, v, 0, sae.cfg.d_sae)


def _positions_arg(positions) -> np.ndarray | None:
    if positions is None:
        return None
    v = [positions] if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool) else positions
    return np.asarray(check_int_list("positions", v, -(1 << 30), 1 << 30), np.intp)


def _at(acts: np.ndarray, pos: np.ndarray | None, feats: list[int], name: str) -> tuple:
    """The index of (positions, features) in acts [..., T, d_sae], positions checked against T."""
    f = np.asarray(feats, np.intp)
    if pos is None:
        return (Ellipsis, f)
    T = acts.shape[-2] if acts.ndim >= 2 else 0
    bad = pos[(pos < -T) | (pos >= T)]
    if bad.size:
        raise Error("hook %s: positions holds %d, out of range for %d positions" % (name, int(bad[0]), T))
    return (Ellipsis, pos[:, None], f[None, :])


def ablate_features(sae: SAE, idx, *, value: float = 0.0, positions=None) -> Hooks:
    """A feature hook that sets features' activations to `value` (0: zero-ablation).

    Parameters
    ----------
    sae : SAE
        The dictionary.
    idx : int or sequence of int
        The features (0 .. d_sae - 1).
    value : float
        What they are set to.
    positions : int or sequence of int or None
        Only at these positions (None: all; negative from the end).

    Returns
    -------
    Hooks
        One (``<hook>.sae.acts``, fn) pair, for run_with_saes / sae_hooks's fwd_hooks.

    Raises
    ------
    dclens.Error
        Not an SAE, a feature out of range (naming idx), a value that is not finite; in the
        pass, a position out of range.
    """
    _check_sae("sae", sae)
    feats = _features_arg(sae, "idx", idx)
    if not is_finite_number(value):
        raise ArgumentError("value must be a finite number, not %r" % (value,))
    pos = _positions_arg(positions)

    def ablate_features(acts, name):
        acts[_at(acts, pos, feats, name)] = value

    return Hooks([(feature_hook_name(sae), ablate_features)])


def steer(sae: SAE, feature, coef: float, *, positions=None) -> Hooks:
    """A feature hook that adds `coef` to a feature's activation: with the dictionary spliced
    in, coef * W_dec[feature] is added to the reconstruction (steering along its direction).

    Parameters
    ----------
    sae : SAE
        The dictionary.
    feature : int or sequence of int
        The feature(s).
    coef : float
        Added to each one's activation (negative: steer away).
    positions : int or sequence of int or None
        Only at these positions (None: all).

    Returns
    -------
    Hooks
        The steering (``<hook>.sae.acts``, fn) pair.

    Raises
    ------
    dclens.Error
        As for ablate_features (naming feature, coef).
    """
    _check_sae("sae", sae)
    feats = _features_arg(sae, "feature", feature)
    if not is_finite_number(coef):
        raise ArgumentError("coef must be a finite number, not %r" % (coef,))
    pos = _positions_arg(positions)

    def steer(acts, name):
        acts[_at(acts, pos, feats, name)] += np.float32(coef)

    return Hooks([(feature_hook_name(sae), steer)])


def patch_features(sae: SAE, source_acts, idx=None, *, positions=None) -> Hooks:
    """A feature hook that writes features' activations from another run (activation patching
    at the level of features): ``patch_features(sae, clean_cache[feature_hook_name(sae)], [4])``.

    Parameters
    ----------
    sae : SAE
        The dictionary.
    source_acts : array_like
        [..., T, d_sae] activations of the other run, of the shape the patched run has.
    idx : int or sequence of int or None
        The features to patch (None: all).
    positions : int or sequence of int or None
        Only at these positions (None: all).

    Returns
    -------
    Hooks
        The patching (``<hook>.sae.acts``, fn) pair.

    Raises
    ------
    dclens.Error
        Not an SAE, source_acts not finite or not ending in d_sae, a feature out of range
        (naming idx); in the pass, source_acts of another shape than the run's.
    """
    _check_sae("sae", sae)
    src = np.array(source_acts, np.float32)
    if src.ndim < 1 or src.shape[-1] != sae.cfg.d_sae:
        raise ArgumentError("source_acts must end in d_sae (%d), not shape %s" % (sae.cfg.d_sae, list(src.shape)))
    if not np.isfinite(src).all():
        raise ArgumentError("source_acts holds NaN or inf")
    feats = list(range(sae.cfg.d_sae)) if idx is None else _features_arg(sae, "idx", idx)
    pos = _positions_arg(positions)

    def patch_features(acts, name):
        if src.shape != acts.shape:
            raise Error(
                "hook %s: source_acts has shape %s, the run's activations %s"
                % (name, list(src.shape), list(acts.shape))
            )
        at = _at(acts, pos, feats, name)
        acts[at] = src[at]

    return Hooks([(feature_hook_name(sae), patch_features)])
