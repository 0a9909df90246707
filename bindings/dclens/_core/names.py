"""Hook names: short names, TransformerLens aliases, and dclens.hook_name.

dclens's own names (shared/docs/hooks.md) are canonical: caches are keyed
by them. Everywhere a hook name is taken (run_with_cache names /
names_filter, run_with_hooks, cache[...], interventions, patching) the
TransformerLens spelling works too:

| TransformerLens                   | dclens                     |
|-----------------------------------|-----------------------------|
| hook_embed                        | embed                       |
| blocks.{l}.hook_resid_pre         | blocks.{l}.resid_pre        |
| blocks.{l}.ln1.hook_normalized    | blocks.{l}.ln_attn          |
| blocks.{l}.hook_q_input / _k / _v | blocks.{l}.attn.q_input / k_input / v_input |
| blocks.{l}.hook_mlp_in            | blocks.{l}.mlp_input        |
| blocks.{l}.attn.hook_q / _k / _v  | blocks.{l}.attn.q / k / v   |
| blocks.{l}.attn.hook_attn_scores  | blocks.{l}.attn.scores      |
| blocks.{l}.attn.hook_pattern      | blocks.{l}.attn.pattern     |
| blocks.{l}.attn.hook_z            | blocks.{l}.attn.z           |
| blocks.{l}.attn.hook_result       | blocks.{l}.attn.head_out    |
| blocks.{l}.hook_attn_out          | blocks.{l}.attn.out         |
| blocks.{l}.ln2.hook_normalized    | blocks.{l}.ln_mlp           |
| blocks.{l}.mlp.hook_pre / _post   | blocks.{l}.mlp.pre / post   |
| blocks.{l}.mlp.hook_pre_linear    | blocks.{l}.mlp.pre_linear (dcformer) |
| blocks.{l}.hook_mlp_out           | blocks.{l}.mlp.out          |
| blocks.{l}.hook_resid_post        | blocks.{l}.resid_post       |
| ln_final.hook_normalized          | ln_final                    |
| (none: the unembed output)        | logits                      |

Notes: TransformerLens' attn_scores are after the mask; dclens's scores are
before composition and mask (masked cells hold q.k). In a DCMHA layer the
weights that multiply v are attn.pattern_composed (post-compose of the
softmax output attn.pattern); in Pythia they are attn.pattern. There is no
resid_mid: DCPythia and Pythia use a parallel residual.
"""

from __future__ import annotations

import re

import numpy as np

from .checks import ArgumentError, Error, check_str, did_you_mean

# The compose branches of a DCMHA phase (hooks blocks.{l}.attn.{phase}.{branch};
# "static" is the use_sw branch, present only in Talking-Heads models).
PHASES = ("pre", "post")
# the split inputs (hooks.md): the residual stream as one reader sees it, materialised on request
SPLIT_INPUTS = ("attn.q_input", "attn.k_input", "attn.v_input", "attn.dyn_input", "mlp_input")
BRANCHES = ("skip", "qp", "kp", "qg", "kg")

# TransformerLens suffix (after "blocks.{l}.") -> dclens suffix
TL_LAYER_ALIASES = {
    "hook_resid_pre": "resid_pre",
    "ln1.hook_normalized": "ln_attn",
    "hook_q_input": "attn.q_input",  # TransformerLens's use_split_qkv_input
    "hook_k_input": "attn.k_input",
    "hook_v_input": "attn.v_input",
    "hook_mlp_in": "mlp_input",  # use_hook_mlp_in
    "attn.hook_q": "attn.q",
    "attn.hook_k": "attn.k",
    "attn.hook_v": "attn.v",
    "attn.hook_attn_scores": "attn.scores",
    "attn.hook_pattern": "attn.pattern",
    "attn.hook_z": "attn.z",
    "attn.hook_result": "attn.head_out",
    "hook_attn_out": "attn.out",
    "ln2.hook_normalized": "ln_mlp",
    "mlp.hook_pre": "mlp.pre",
    "mlp.hook_post": "mlp.post",
    "mlp.hook_pre_linear": "mlp.pre_linear",  # DCFormer++'s gated MLP (w3 x)
    "hook_mlp_out": "mlp.out",
    "hook_resid_post": "resid_post",
}
TL_GLOBAL_ALIASES = {
    "hook_embed": "embed",
    "ln_final.hook_normalized": "ln_final",
}
_REVERSE_LAYER = {v: k for k, v in TL_LAYER_ALIASES.items()}
_REVERSE_GLOBAL = {v: k for k, v in TL_GLOBAL_ALIASES.items()}

# Short names for hook_name() / cache[short, layer]: TransformerLens' short
# names (get_act_name) plus dclens's suffixes.
SHORT = {
    "embed": "embed",
    "ln_final": "ln_final",
    "logits": "logits",
    "normalized": "ln_final",
    "resid_pre": "resid_pre",
    "resid_post": "resid_post",
    "ln1": "ln_attn",
    "ln_attn": "ln_attn",
    "ln2": "ln_mlp",
    "ln_mlp": "ln_mlp",
    "q": "attn.q",
    "k": "attn.k",
    "v": "attn.v",
    "z": "attn.z",
    "scores": "attn.scores",
    "attn_scores": "attn.scores",
    "scores_composed": "attn.scores_composed",
    "pattern": "attn.pattern",
    "attn": "attn.pattern",
    "pattern_composed": "attn.pattern_composed",
    "result": "attn.head_out",
    "head_out": "attn.head_out",
    "attn_out": "attn.out",
    "pre": "mlp.pre",
    "post": "mlp.post",
    "mlp_pre": "mlp.pre",
    "mlp_post": "mlp.post",
    "mlp_out": "mlp.out",
    "pre_linear": "mlp.pre_linear",
    "mlp_gate": "mlp.gate",
}
_GLOBAL = {"embed", "ln_final", "logits"}


def _respell(name: str, global_table: dict[str, str], layer_table: dict[str, str]) -> str | None:
    """A hook name in the other spelling by the two tables (a global name;
    blocks.{l}.<suffix> by its suffix), or None when they do not have it."""
    if name in global_table:
        return global_table[name]
    m = re.match(r"^blocks\.(\d+)\.(.+)$", name)
    if m and m.group(2) in layer_table:
        return "blocks.%s.%s" % (m.group(1), layer_table[m.group(2)])
    return None


def canonical(name: str) -> str:
    """The dclens name of a hook given in either spelling.

    Parameters
    ----------
    name : str
        A full hook name, dclens's ("blocks.3.attn.pattern") or TransformerLens'
        ("blocks.3.attn.hook_pattern").

    Returns
    -------
    str
        The dclens name; a name neither table knows (or a non-string) is returned
        unchanged, for the engine to report.
    """
    if not isinstance(name, str):
        return name
    out = _respell(name, TL_GLOBAL_ALIASES, TL_LAYER_ALIASES)
    return name if out is None else out


def tl_alias(name: str) -> str | None:
    """The TransformerLens spelling of a dclens hook name.

    Parameters
    ----------
    name : str
        A full dclens hook name ("blocks.3.attn.pattern").

    Returns
    -------
    str or None
        Its TransformerLens name ("blocks.3.attn.hook_pattern"), or None if it has none
        (the compose branches, the dynamic weights, ...).

    Raises
    ------
    dclens.Error
        `name` is not a string, or holds a NUL character.
    """
    check_str("hook name", name)
    return _respell(name, _REVERSE_GLOBAL, _REVERSE_LAYER)


def hook_names(model) -> list[str]:
    """Every hook name of a loaded model, in forward order per layer.

    The installed source of the names an unknown-hook error points to. TransformerLens
    spellings are in this module's table.

    Parameters
    ----------
    model : dclens.Model
        A loaded model.

    Returns
    -------
    list of str
        Its model.hook_names, dclens spelling ("embed", "blocks.0.resid_pre", ...).
    """
    return list(model.hook_names)


def name_and_layer(a, b=None) -> tuple[str, int | None]:
    """hook_name's two arguments, given in either order, as (name, layer).

    Parameters
    ----------
    a : str or int
        The name, or the layer when `b` is the name.
    b : str or int or None
        The layer, or the name.

    Returns
    -------
    tuple
        (name, layer): swapped when `a` is not a string and `b` is one.
    """
    if not isinstance(a, str) and isinstance(b, str):
        return b, a
    return a, b


def hook_name(name, layer=None) -> str:
    """The full dclens hook name of a short name and a layer, in either order:

        hook_name(3, "attn.post.kp")  -> "blocks.3.attn.post.kp"
        hook_name("post.kp", 3)       -> "blocks.3.attn.post.kp"
        hook_name("pattern", 3)       -> "blocks.3.attn.pattern"   (TransformerLens' get_act_name)
        hook_name("embed")            -> "embed"

    The name is a suffix after "blocks.{l}." ("attn.post.kp", "resid_post"),
    a short name ("pattern", "z", "pre.kp" for "attn.pre.kp") or a full name
    in either spelling (returned canonical). A negative layer counts from
    the end only through Model.hook_name (it needs n_layer). Every module
    of dclens builds its hook names here.

    Parameters
    ----------
    name : str or int
        The name: a suffix, a short name or a full name (or the layer, when `layer` is
        the name).
    layer : int or None
        The layer (>= 0) of a per-layer hook; None for "embed", "ln_final", "logits" and
        for full names.

    Returns
    -------
    str
        The full dclens hook name.

    Raises
    ------
    dclens.ArgumentError
        The name is not a string, or the layer is not an integer >= 0.
    dclens.Error
        An unknown short name, a layer given for a global hook, or none for a per-layer one.
    """
    name, layer = name_and_layer(name, layer)
    if not isinstance(name, str):
        raise ArgumentError("hook_name: name must be a string, not %r" % (name,))
    full = canonical(name)
    if full.startswith("blocks.") or full in _GLOBAL:
        if layer is not None and full in _GLOBAL:
            raise Error("hook_name: %r is not a per-layer hook (no layer)" % name)
        return full
    suffix = TL_LAYER_ALIASES.get(name) or SHORT.get(name)
    if suffix is None:
        if name.startswith(("attn.", "mlp.")):
            suffix = name
        elif name.startswith(("pre.", "post.", "dyn.")):
            suffix = "attn." + name
        else:
            raise Error(
                "hook_name: unknown short name %r (known: %s, or a suffix such as 'attn.post.kp')"
                % (name, ", ".join(sorted(SHORT)))
            )
    if suffix in _GLOBAL:
        if layer is not None:
            raise Error("hook_name: %r is not a per-layer hook (no layer)" % name)
        return suffix
    if layer is None:
        raise Error("hook_name: %r is a per-layer hook: give a layer" % name)
    if not isinstance(layer, (int,)) or isinstance(layer, bool) or layer < 0:
        try:
            if isinstance(layer, np.integer) and layer >= 0:
                layer = int(layer)
            else:
                raise TypeError
        except TypeError:
            raise ArgumentError("hook_name: layer must be an integer >= 0, not %r" % (layer,)) from None
    return "blocks.%d.%s" % (layer, suffix)


def suggest(wanted, names, n: int = 5):
    """The hook names closest to what was asked for, for "did you mean" messages.

    Parameters
    ----------
    wanted : str or iterable of str
        The string(s) asked for: full names, or suffixes such as 'hook_patern' matched
        against the part after 'blocks.{l}.' in either spelling.
    names : iterable of str
        The model's hook names (dclens spelling).
    n : int
        At most this many names.

    Returns
    -------
    list of str
        Full dclens names of `names`, closest first (difflib), without repeats.
    """
    wanted = [wanted] if isinstance(wanted, str) else [w for w in wanted if isinstance(w, str) and len(w) > 1]
    names = list(names)
    by_key: dict[str, str] = {}
    for full in names:
        for key in {full, tl_alias(full) or full}:
            by_key.setdefault(key, full)
            m = re.match(r"^blocks\.\d+\.(.+)$", key)
            if m:
                by_key.setdefault(m.group(1), full)
    out = []
    for w in wanted:
        for key in did_you_mean(w, by_key, n):
            if key not in out:
                out.append(key)
    return out[:n]


def predicate_strings(fn):
    """The string constants a predicate's code and closure mention.

    For saying what a names_filter that matches nothing was probably after.

    Parameters
    ----------
    fn : callable
        The predicate (a function or lambda; anything else gives what it can).

    Returns
    -------
    list of str
        Its string constants (nested code included) and the strings of its closure
        (directly or in a list, tuple or set), without empty strings, format strings
        and strings with spaces.
    """
    found = []
    code = getattr(fn, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        for k in c.co_consts:
            if isinstance(k, str):
                found.append(k)
            elif hasattr(k, "co_consts"):
                stack.append(k)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, str):
            found.append(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            found += [x for x in v if isinstance(x, str)]
    return [s for s in found if s and not s.startswith(("%", "\n")) and " " not in s]
