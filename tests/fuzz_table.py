"""The table the API fuzz (tests/api/test_fuzz_api.py) walks: every public
function and method of dclens with a strategy for each argument's valid
values. The fuzz replaces some arguments by hostile values (wrong types,
shapes, dtypes, signs, sizes) and asks for a valid result or a dclens.Error
that names one of the replaced arguments.

To fuzz a new function, add one Entry: a name, the call (``f(ctx, **kw)``,
ctx holding the fixture model, a twin with the static branch (use_sw) as
"sw", a cache and a temporary directory), and
``args``: argument name -> strategy of valid values. ``names`` gives, per
argument, the words a refusal may use for it when they differ from its name
(``tokens``: "token id"...).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dclens
from dclens import analysis, attribution, cache, circuits, grad, interventions, names, patching, routing

L, N, V, T = 2, 4, 64, 6  # the fixture model: layers, heads, vocabulary; prompt length


@dataclasses.dataclass
class Entry:
    name: str
    call: Callable
    args: dict[str, st.SearchStrategy]
    names: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------ hostile values

_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint64, np.bool_, np.complex64]

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, -2, 0, 1, L, N, V, 2**31 - 1, 2**31, 2**63, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, -0.0, 1.0, 1e300]),
    st.text(max_size=6),
    st.sampled_from(["", "\0", "a\0b", "blocks.0.attn.z", "attn.z", "all", "pre", "kp", "\udcff", "../x", "-1", "1e9"]),
    st.binary(max_size=6),
    hnp.arrays(st.sampled_from(_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)),
    st.lists(st.integers(-3, 70), max_size=5),
    st.sampled_from([[[1], [1, 2]], [1, "a"], [None], [[1, 2], [3]], (), [], {}, [0.5, 1.5]]),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 5), max_size=2),
    st.sampled_from(
        [
            object(),
            np.array([1, "a"], dtype=object),
            np.int64(-1),
            np.float32("nan"),
            np.array(3),
            lambda *a: None,
            type,
            Ellipsis,
            slice(0, 2),
            range(3),
            1j,
        ]
    ),
)


# ------------------------------------------------------------------ valid values


def tokens_1d(lo=1, hi=T):
    return hnp.arrays(np.int64, st.integers(lo, hi), elements=st.integers(0, V - 1))


TOKENS = st.one_of(
    tokens_1d(), hnp.arrays(np.int64, st.tuples(st.integers(1, 2), st.integers(1, T)), elements=st.integers(0, V - 1))
)
LAYER = st.integers(0, L - 1)
HEAD = st.integers(0, N - 1)
TOKEN = st.integers(0, V - 1)
POS = st.integers(-T, T - 1)
PHASE = st.sampled_from(["pre", "post"])
BRANCH = st.sampled_from(list(dclens.BRANCHES))
BOOL = st.booleans()
SUFFIX = st.sampled_from(["attn.z", "attn.pattern", "resid_pre", "mlp.out", "attn.post.kp", "attn.scores"])
HOOK = st.builds(lambda l, s: "blocks.%d.%s" % (l, s), LAYER, SUFFIX)
TARGET = st.one_of(
    st.just("loss"),
    st.tuples(st.just("logit"), st.integers(-1, 2), TOKEN),
    st.tuples(st.just("logprob"), st.integers(-1, 2), TOKEN),
    st.tuples(st.just("logit_diff"), st.just(-1), TOKEN, TOKEN),
)
METRIC = st.builds(patching.logit_diff, TOKEN, TOKEN)
LAYERS = st.one_of(st.none(), st.lists(LAYER, min_size=1, max_size=2, unique=True))
DATASET = st.lists(tokens_1d(2, T), min_size=1, max_size=2)
MAPS = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)), elements=st.floats(-1, 1, width=32)
)


def _m(ctx):
    return ctx["model"]


def _with_attention_rows(model, rows, tokens):
    """A forward with model.attention_rows = rows, the setting put back after."""
    before = model.attention_rows
    try:
        model.attention_rows = rows
        return model.forward(tokens)
    finally:
        model.attention_rows = before


def _ctok(ctx):
    return ctx["toks"]


ENTRIES = [
    # ---- the model
    Entry(
        "load",
        lambda c, path, device, n_threads, dtype: dclens.load(path, device=device, n_threads=n_threads, dtype=dtype),
        dict(
            path=st.just(None),
            device=st.just("cpu"),
            n_threads=st.integers(0, 2),
            dtype=st.sampled_from(["auto", "float32", "float16", "bfloat16", np.float16]),
        ),
        dict(path=("path", "model", "directory", "config.json", "bundled", "no such")),
    ),
    Entry(
        "Model.forward",
        lambda c, tokens, return_type, padding_side, loss_per_token, logits_at: _m(c).forward(
            tokens,
            return_type=return_type,
            padding_side=padding_side,
            loss_per_token=loss_per_token,
            logits_at=logits_at,
        ),
        dict(
            tokens=st.one_of(  # at least 2 tokens: return_type "loss" needs a next token
                tokens_1d(2),
                hnp.arrays(np.int64, st.tuples(st.integers(1, 2), st.integers(2, T)), elements=st.integers(0, V - 1)),
            ),
            return_type=st.sampled_from(["logits", "loss", "both", None]),
            padding_side=st.sampled_from(["right", "left"]),
            loss_per_token=BOOL,
            logits_at=st.none(),  # with return_type "logits" only, no loss_per_token: its hostile values are fuzzed
        ),
        dict(
            tokens=("token", "prompt", "sequence", "loss"), logits_at=("logits_at",), loss_per_token=("loss_per_token",)
        ),
    ),
    Entry(
        "Model.forward(lengths)",
        lambda c, tokens, lengths: _m(c).forward(tokens, lengths=lengths),
        dict(
            tokens=hnp.arrays(np.int64, (2, T), elements=TOKEN),
            lengths=st.lists(st.integers(1, T), min_size=2, max_size=2),
        ),
        dict(tokens=("token",), lengths=("length",)),
    ),
    Entry(
        "Model.run_with_cache",
        lambda c, tokens, names: _m(c).run_with_cache(tokens, names=names),
        dict(tokens=TOKENS, names=st.one_of(st.none(), st.lists(HOOK, max_size=2), st.just(lambda n: "z" in n))),
        dict(tokens=("token", "prompt"), names=("name", "hook")),
    ),
    Entry(
        "Model.run_with_hooks",
        lambda c, tokens, fwd_hooks: _m(c).run_with_hooks(tokens, fwd_hooks=fwd_hooks),
        dict(tokens=TOKENS, fwd_hooks=st.lists(st.tuples(HOOK, st.just(lambda a, n: None)), max_size=2)),
        dict(tokens=("token", "prompt"), fwd_hooks=("hook",)),
    ),
    Entry(
        "Model.generate",
        lambda c, prompt, max_new_tokens, temperature, top_k, stop, seed: _m(c).generate(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, stop=stop, seed=seed
        ),
        dict(
            prompt=tokens_1d(),
            max_new_tokens=st.integers(0, 3),
            temperature=st.floats(0, 2),
            top_k=st.one_of(st.none(), st.integers(1, V)),
            stop=st.one_of(st.none(), TOKEN, st.lists(TOKEN)),
            seed=st.one_of(st.none(), st.integers(0, 2**32)),
        ),
        dict(prompt=("prompt", "token")),
    ),
    Entry(
        "Model.attention_rows",
        lambda c, rows, tokens: _with_attention_rows(_m(c), rows, tokens),
        dict(rows=st.integers(-1, 40), tokens=tokens_1d()),
        dict(rows=("attention_rows",), tokens=("token",)),
    ),
    Entry(
        "Decoder.step",
        lambda c, tokens: dclens.Decoder(_m(c)).step(tokens),
        dict(tokens=tokens_1d()),
        dict(tokens=("token",)),
    ),
    Entry(
        "Model.gradients",
        lambda c, tokens, target, wrt: _m(c).gradients(tokens, target, wrt),
        dict(
            tokens=tokens_1d(3),
            target=TARGET,
            wrt=st.lists(
                st.sampled_from(["blocks.0.attn.z", "blocks.1.resid_pre", "layers.0.attention.wo.weight"]),
                min_size=1,
                max_size=2,
                unique=True,
            ),
        ),
        dict(tokens=("token", "sequence"), target=("target",), wrt=("wrt", "hook", "weight", "tensor")),
    ),
    Entry(
        "Model.attribute",
        lambda c, tokens, target, at, method, steps: _m(c).attribute(
            tokens, target, at, method=method, steps=steps, progress=False
        ),
        dict(
            tokens=tokens_1d(3),
            target=TARGET,
            at=st.lists(
                st.sampled_from(["blocks.0.attn.z", "blocks.1.attn.head_out", "blocks.1.mlp.out"]),
                min_size=1,
                max_size=2,
                unique=True,
            ),
            method=st.sampled_from(["ig", "grad_x_act"]),
            steps=st.integers(1, 4),
        ),
        dict(tokens=("token", "sequence"), target=("target",), at=("at", "hook")),
    ),
    Entry(
        "Model.routing_matrix",
        lambda c, tokens, layer, phase, query: _m(c).routing_matrix(tokens, layer, phase, query),
        dict(tokens=tokens_1d(), layer=LAYER, phase=PHASE, query=st.integers(-1, 0)),
        dict(tokens=("token",), phase=("phase",)),
    ),
    Entry(
        "Model.composition_map",
        lambda c, tokens, layer, phase, query, key: _m(c).composition_map(tokens, layer, phase, query, key),
        dict(tokens=tokens_1d(), layer=LAYER, phase=PHASE, query=st.integers(-1, 0), key=st.integers(0, 0)),
        dict(tokens=("token",)),
    ),
    Entry(
        "Model.gates",
        lambda c, tokens, layer: _m(c).gates(tokens, layer),
        dict(tokens=tokens_1d(), layer=LAYER),
        dict(tokens=("token",)),
    ),
    Entry(
        "Model.weight",
        lambda c, name: _m(c).weight(name),
        dict(name=st.sampled_from(["tok_embeddings.weight", "layers.0.attention.wo.weight"])),
        dict(name=("weight", "name", "tensor")),
    ),
    Entry(
        "Model.hook_name",
        lambda c, name, layer: _m(c).hook_name(name, layer),
        dict(name=SUFFIX, layer=LAYER),
        dict(name=("hook", "name")),
    ),
    Entry("Model.resolve_hook", lambda c, name: _m(c).resolve_hook(name), dict(name=HOOK), dict(name=("hook",))),
    Entry("Model.parse_hook", lambda c, name: _m(c).parse_hook(name), dict(name=HOOK), dict(name=("hook",))),
    Entry(
        "Model.to_string",
        lambda c, tokens: _m(c).to_string(tokens),
        dict(tokens=tokens_1d()),
        dict(tokens=("token", "tokenizer")),
    ),
    Entry(
        "Model.to_tokens",
        lambda c, text: _m(c).to_tokens(text),
        dict(text=st.text(max_size=5)),
        dict(text=("text", "tokenizer", "string")),
    ),
    Entry(
        "Model.to_str_tokens",
        lambda c, tokens: _m(c).to_str_tokens(tokens),
        dict(tokens=tokens_1d()),
        dict(tokens=("token", "tokenizer", "text")),
    ),
    Entry(
        "Model.add_hook",
        lambda c, name, fn, read_only: (_m(c).add_hook(name, fn, read_only=read_only), _m(c).reset_hooks()),
        dict(name=HOOK, fn=st.just(lambda a, n: None), read_only=BOOL),
        dict(name=("hook",), fn=("fn", "hook")),
    ),
    # ---- names
    Entry(
        "hook_name",
        lambda c, name, layer: dclens.hook_name(name, layer),
        dict(name=SUFFIX, layer=LAYER),
        dict(name=("hook", "name")),
    ),
    Entry("names.canonical", lambda c, name: names.canonical(name), dict(name=HOOK), dict(name=("hook", "name"))),
    Entry("names.tl_alias", lambda c, name: names.tl_alias(name), dict(name=HOOK), dict(name=("hook", "name"))),
    # ---- circuits
    Entry(
        "circuits.qk_circuit",
        lambda c, layer, head: circuits.qk_circuit(_m(c), layer, head).full(),
        dict(layer=LAYER, head=HEAD),
    ),
    Entry(
        "circuits.ov_circuit",
        lambda c, layer, head: circuits.ov_circuit(_m(c), layer, head).full(),
        dict(layer=LAYER, head=HEAD),
    ),
    Entry(
        "circuits.ov_logits",
        lambda c, layer, head, tokens: circuits.ov_logits(_m(c), layer, head, tokens),
        dict(layer=LAYER, head=HEAD, tokens=tokens_1d()),
        dict(tokens=("token",)),
    ),
    Entry(
        "circuits.ov_readout",
        lambda c, layer, head, token, k: circuits.ov_readout(_m(c), layer, head, token, k),
        dict(layer=LAYER, head=HEAD, token=TOKEN, k=st.integers(1, 5)),
    ),
    Entry(
        "circuits.head_diversity",
        lambda c, layer, kind: circuits.head_diversity(_m(c), layer, kind),
        dict(layer=LAYER, kind=st.sampled_from(["qk", "ov"])),
    ),
    Entry(
        "circuits.diversity_curve",
        lambda c, layer, kind: circuits.diversity_curve(_m(c), layer, kind),
        dict(layer=LAYER, kind=st.sampled_from(["qk", "ov"])),
    ),
    Entry(
        "circuits.FactoredMatrix",
        lambda c, A, B: circuits.FactoredMatrix(A, B).full(),
        dict(
            A=hnp.arrays(np.float32, (3, 2), elements=st.floats(-1, 1, width=32)),
            B=hnp.arrays(np.float32, (2, 4), elements=st.floats(-1, 1, width=32)),
        ),
        dict(A=("a", "factor", "shape"), B=("b", "factor", "shape")),
    ),
    # ---- routing
    Entry(
        "routing.dynamic_weights",
        lambda c, tokens, layer, phase: routing.dynamic_weights(_m(c), tokens, layer, phase),
        dict(tokens=tokens_1d(), layer=LAYER, phase=PHASE),
        dict(tokens=("token",)),
    ),
    Entry(
        "routing.static_map",
        lambda c, layer, phase: routing.static_map(c["sw"], layer, phase),
        dict(layer=LAYER, phase=PHASE),
    ),
    Entry(
        "routing.composition_maps",
        lambda c, layer, phase, query, key: routing.composition_maps(
            _m(c), c["cache"], layer, phase, query=query, key=key
        ),
        dict(
            layer=LAYER,
            phase=PHASE,
            query=st.one_of(st.none(), st.integers(-1, 0)),
            key=st.one_of(st.none(), st.integers(0, 0)),
        ),
    ),
    Entry(
        "routing.routing_matrices",
        lambda c, phase, layers, queries: routing.routing_matrices(
            _m(c), c["cache"], phase, layers=layers, queries=queries
        ),
        dict(
            phase=PHASE,
            layers=LAYERS,
            queries=st.one_of(st.none(), st.lists(st.integers(0, T - 1), min_size=1, max_size=2)),
        ),
    ),
    Entry(
        "routing.gates_from_cache",
        lambda c, layer: routing.gates_from_cache(_m(c), c["cache"], layer),
        dict(layer=LAYER),
    ),
    Entry(
        "routing.maps_from_weights",
        lambda c, query, groups: routing.maps_from_weights(
            routing.dynamic_weights(_m(c), _ctok(c), 0, "post"), query, groups=groups
        ),
        dict(query=st.integers(0, T - 1), groups=st.just(1)),
    ),
    # ---- interventions (built, then run)
    Entry(
        "interventions.ablate_head",
        lambda c, layer, head, kind, point: _m(c).run_with_hooks(
            _ctok(c),
            [
                interventions.ablate_head(
                    _m(c),
                    layer,
                    head,
                    kind=kind,
                    point=point,
                    mean=None
                    if not (isinstance(kind, str) and kind == "mean")
                    else np.zeros(  # one head's slice at the point: Dh, a pattern row (the prompt's T), D
                        {"attn.pattern": len(_ctok(c)), "attn.head_out": _m(c).config.d_model}.get(
                            point, _m(c).config.head_dim
                        )
                        if isinstance(point, str)
                        else 8,
                        np.float32,
                    ),
                )
            ],
        ),
        dict(
            layer=LAYER,
            head=HEAD,
            kind=st.sampled_from(["zero", "mean"]),
            point=st.sampled_from(["attn.z", "attn.pattern", "attn.head_out"]),
        ),
    ),
    Entry(
        "interventions.disable_branch",
        lambda c, phase, branch, layers: _m(c).run_with_hooks(
            _ctok(c), interventions.disable_branch(_m(c), phase, branch, layers=layers)
        ),
        dict(phase=PHASE, branch=BRANCH, layers=LAYERS),
    ),
    Entry(
        "interventions.disable_dynamic",
        lambda c, layers: _m(c).run_with_hooks(_ctok(c), interventions.disable_dynamic(_m(c), layers=layers)),
        dict(layers=LAYERS),
    ),
    Entry(
        "interventions.disable_static",
        lambda c, phases, layers: c["sw"].run_with_hooks(
            _ctok(c), interventions.disable_static(c["sw"], phases=phases, layers=layers)
        ),
        dict(phases=st.sampled_from([("pre",), ("post",), ("pre", "post")]), layers=LAYERS),
    ),
    Entry(
        "interventions.scale",
        lambda c, name, factor: _m(c).run_with_hooks(
            _ctok(c),
            [
                interventions.scale(_m(c), name[0], factor, head=name[1])
                if isinstance(name, tuple) and len(name) == 2
                else interventions.scale(_m(c), name, factor)
            ],
        ),
        dict(
            name=st.one_of(
                st.tuples(HOOK, st.none()),  # any hook, whole; a head of a hook with a head axis
                st.tuples(st.builds(lambda l: "blocks.%d.attn.z" % l, LAYER), HEAD),
            ),
            factor=st.floats(-2, 2),
        ),
        dict(
            name=("hook", "head"),
        ),
    ),
    Entry(
        "interventions.patch",
        lambda c, name, head, positions: _m(c).run_with_hooks(
            _ctok(c), [interventions.patch(_m(c), name, c["cache"], head=head, positions=positions)]
        ),
        dict(
            name=st.sampled_from(["blocks.0.attn.z", "blocks.1.attn.v"]),  # hooks with a head axis (head=)
            head=st.one_of(st.none(), HEAD),
            positions=st.one_of(st.none(), st.lists(st.integers(0, T - 1), min_size=1, max_size=2)),
        ),
        dict(name=("hook",), positions=("position",)),
    ),
    Entry(
        "interventions.mean_activation",
        lambda c, layer, head, point: interventions.mean_activation(c["cache"], layer, head, point=point),
        dict(layer=LAYER, head=HEAD, point=st.sampled_from(["attn.z", "attn.pattern"])),
        dict(point=("point", "hook")),
    ),
    # ---- patching
    Entry(
        "patching.sweep",
        lambda c, metric, over, layers: patching.sweep(
            _m(c), _ctok(c), c["toks2"], metric, over=over, layers=layers, progress=False
        ),
        dict(metric=METRIC, over=st.sampled_from(["layer,head", "layer,pos", "layer,phase,branch"]), layers=LAYERS),
        dict(metric=("metric",), over=("over",)),
    ),
    Entry(
        "patching.ablation_sweep",
        lambda c, metric, over, layers, mode: patching.ablation_sweep(
            _m(c),
            _ctok(c),
            metric,
            over=over,
            layers=layers,
            mode=mode,
            reference=[c["toks2"]] if isinstance(mode, str) and mode == "mean" else None,
            progress=False,
        ),
        dict(
            metric=METRIC,
            over=st.sampled_from(["layer,head", "source", "composition"]),
            layers=LAYERS,
            mode=st.sampled_from(["zero", "mean"]),
        ),
        dict(metric=("metric",), over=("over",), mode=("mode", "reference")),
    ),
    Entry(
        "interventions.block_lending",
        lambda c, layer, head, phase, branches: _m(c).run_with_hooks(
            _ctok(c), interventions.block_lending(_m(c), layer, head, phase=phase, branches=branches)
        ),
        dict(
            layer=LAYER,
            head=HEAD,
            phase=st.sampled_from(["pre", "post", "both"]),
            branches=st.lists(st.sampled_from(["qp", "kp"]), min_size=1, max_size=2, unique=True),  # no static map
        ),
        dict(branches=("branch",)),
    ),
    Entry(
        "routing.flows",
        lambda c, layer, phase, head, query: routing.flows(_m(c), _ctok(c), layer, phase, head, query),
        dict(layer=LAYER, phase=PHASE, head=HEAD, query=st.integers(0, T - 1)),
        dict(query=("query", "position")),
    ),
    Entry(
        "patching.run_patched",
        lambda c, tokens, names: patching.run_patched(_m(c), tokens, c["cache"], names),
        dict(
            tokens=st.just(None),
            names=st.lists(st.sampled_from(["blocks.0.attn.z", "blocks.1.resid_pre"]), min_size=1, max_size=2),
        ),
        dict(tokens=("token", "shape"), names=("name", "hook")),
    ),
    Entry(
        "patching.metrics",
        lambda c, a, b, pos: (
            patching.logit_diff(a, b, pos)(c["logits"]),
            patching.prob(a, pos)(c["logits"]),
            patching.logprob(b, pos)(c["logits"]),
        ),
        dict(a=TOKEN, b=TOKEN, pos=POS),
        dict(a=("correct", "token"), b=("wrong", "token"), pos=("pos",)),
    ),
    # ---- cache
    Entry(
        "cache.accumulated_resid",
        lambda c, layer, apply_ln: cache.accumulated_resid(c["cache"], layer=layer, apply_ln=apply_ln),
        dict(layer=st.one_of(st.none(), st.integers(0, L)), apply_ln=BOOL),
    ),
    Entry(
        "cache.decompose_resid",
        lambda c, layer, apply_ln: cache.decompose_resid(c["cache"], layer=layer, apply_ln=apply_ln),
        dict(layer=st.one_of(st.none(), st.integers(0, L)), apply_ln=BOOL),
    ),
    Entry(
        "cache.stack_head_results",
        lambda c, layer, apply_ln: cache.stack_head_results(c["cache"], layer=layer, apply_ln=apply_ln),
        dict(layer=st.one_of(st.none(), st.integers(0, L)), apply_ln=BOOL),
    ),
    Entry(
        "cache.dla",
        lambda c, token, pos, by: cache.dla(c["cache"], token, pos=pos, by=by),
        dict(token=TOKEN, pos=POS, by=st.sampled_from(["head", "layer"])),
    ),
    Entry(
        "cache.logit_attrs",
        lambda c, tokens: cache.logit_attrs(c["cache"], cache.decompose_resid(c["cache"]), tokens),
        dict(tokens=st.one_of(TOKEN, hnp.arrays(np.int64, (T,), elements=TOKEN))),
        dict(tokens=("token",)),
    ),
    Entry(
        "Cache.__getitem__",
        lambda c, key: c["cache"][key],
        dict(key=st.one_of(HOOK, st.tuples(st.sampled_from(["pattern", "z", "resid_pre"]), LAYER))),
        dict(key=("key", "hook", "name")),
    ),
    # ---- analysis
    Entry(
        "analysis.head_output_pca",
        lambda c, dataset, layers, mode: analysis.head_output_pca(
            _m(c), dataset, layers=layers, mode=mode, progress=False
        ),
        dict(dataset=DATASET, layers=LAYERS, mode=st.sampled_from(["heads", "tokens"])),
        dict(dataset=("dataset", "sequence", "token")),
    ),
    Entry(
        "analysis.qk_ov_diversity",
        lambda c, layers: analysis.qk_ov_diversity(_m(c), layers=layers),
        dict(layers=LAYERS),
    ),
    Entry(
        "analysis.head_similarity",
        lambda c, layer, dataset, kind: analysis.head_similarity(
            _m(c), layer, dataset=dataset, kind=kind, progress=False
        ),
        dict(layer=LAYER, dataset=DATASET, kind=st.sampled_from(["output", "qk", "ov"])),  # "output" needs one
        dict(dataset=("dataset", "sequence", "token")),
    ),
    Entry(
        "analysis.composition_stats",
        lambda c, dataset, layers, top, chunk: analysis.composition_stats(
            _m(c), dataset, layers=layers, top=top, chunk=chunk, progress=False
        ),
        dict(dataset=DATASET, layers=LAYERS, top=st.integers(1, 4), chunk=st.integers(1, 8)),
        dict(dataset=("dataset", "sequence", "token")),
    ),
    # ---- gradients (module level)
    Entry(
        "grad.target_value_and_grad",
        lambda c, target: grad.target_value_and_grad(target, c["logits"][None], _ctok(c)[None]),
        dict(target=TARGET),
        dict(target=("target",)),
    ),
    Entry(
        "attribution.attribute",
        lambda c, tokens, target, at, baseline: attribution.attribute(
            _m(c), tokens, target, at, steps=2, baseline=baseline, progress=False
        ),
        dict(
            tokens=tokens_1d(3),
            target=TARGET,
            at=st.just(["blocks.0.attn.z"]),
            baseline=st.sampled_from(["zero", "mean"]),
        ),
        dict(tokens=("token",), target=("target",), at=("at", "hook")),
    ),
    # ---- heatmaps
    Entry(
        "heatmap",
        lambda c, maps, tokens, vmin, vmax, grid_cols, cell_px, mask_upper, diverging: dclens.heatmap(
            maps,
            tokens=tokens,
            vmin=vmin,
            vmax=vmax,
            grid_cols=grid_cols,
            cell_px=cell_px,
            mask_upper=mask_upper,
            diverging=diverging,
        ),
        dict(
            maps=MAPS,
            tokens=st.none(),
            vmin=st.none(),
            vmax=st.none(),
            grid_cols=st.integers(0, 3),
            cell_px=st.integers(0, 12),
            mask_upper=BOOL,
            diverging=BOOL,
        ),
        dict(maps=("maps",), tokens=("label", "token"), vmin=("vmin",), vmax=("vmax",)),
    ),
    Entry(
        "attention_heatmap",
        lambda c, tokens, layer, head, hook, phase: dclens.attention_heatmap(
            _m(c), tokens, layer=layer, head=head, hook=hook, phase=phase
        ),
        dict(
            tokens=tokens_1d(),
            layer=LAYER,  # one layer and one head: what every hook, "branches" included, takes
            head=HEAD,
            hook=st.sampled_from(["pattern", "scores", "pattern_composed", "post.kp", "branches"]),
            phase=PHASE,
        ),
        dict(tokens=("token", "text", "prompt"), hook=("hook",)),
    ),
]
