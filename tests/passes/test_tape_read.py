"""The tape's forward reading activations (dcs_tape_forward_read,
Tape.forward(reads=...)): what edge attribution takes from its one clean
pass. The values read are the bits a plain forward's cache gives, the logits
and the backward are those of a forward without reads, and the backward's
recomputation (a tape under a small budget) reads nothing again."""

import warnings

import numpy as np
import pytest

import dclens
from dclens import memplan, tapes

CONFIGS = {
    "dcpythia": dict(model_type="dcpythia", n_layer=2, window_size=5, vocab=24, seed=5),
    "gpt_neox": dict(model_type="gpt_neox", n_layer=2, vocab=24, seed=6),
    "dcformer": dict(model_type="dcformer", n_layer=2, intermediate=64, mgate_dim=4, vocab=24, seed=7),
}
NAMES = [
    "embed",
    "blocks.0.attn.head_out",
    "blocks.1.mlp.out",
    "blocks.1.attn.q_input",
    "blocks.0.attn.scores",
    "blocks.1.attn.pattern",
    "blocks.1.attn.dyn.post.qw1",
    "blocks.1.resid_post",
]


def _load(tiny_factory, name):
    d, _sd, _cfg = tiny_factory(**CONFIGS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dclens.LoadWarning)
        return dclens.load(d)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("budget", ["full", "recompute"])
def test_reads_are_the_forwards_bits(tiny_factory, name, budget):
    m = _load(tiny_factory, name)
    names = [n for n in NAMES if n in m.hook_names]
    toks = np.random.default_rng(3).integers(0, m.config.vocab, (2, 11))
    logits, cache = m.run_with_cache(toks, names=names)
    pts = [m.parse_hook(n) for n in names]
    B, T = toks.shape
    full = memplan.tape_bytes(m, B, T, False, (), 0)
    cap = memplan.check_budget(None, m) if budget == "full" else full - 1  # under it: recompute layers
    wrt = [m.parse_hook("blocks.0.attn.q_input"), m.parse_hook("embed")]
    dl = np.random.default_rng(4).standard_normal(logits.shape).astype(np.float32)
    with tapes.lease(m, B, T, cap) as tp:
        assert tp.memory_recompute == (budget == "recompute")
        plain = tp.forward(toks)
        g_plain = tp.backward(dl, None, wrt)
        lg, got = tp.forward(toks, reads=pts)
        g_read = tp.backward(dl, None, wrt)
    np.testing.assert_array_equal(lg, plain)
    np.testing.assert_array_equal(lg, logits)
    for n, p in zip(names, pts):
        np.testing.assert_array_equal(got[p], np.asarray(cache[n]), err_msg=n)
    for p in wrt:
        np.testing.assert_array_equal(g_read[p], g_plain[p])


def test_a_bad_read_is_an_error(tiny_factory):
    m = _load(tiny_factory, "gpt_neox")
    toks = np.zeros((1, 4), np.int64)
    with tapes.lease(m, 1, 4, memplan.check_budget(None, m)) as tp:
        with pytest.raises(dclens.Error, match="bad read 0"):
            tp.forward(toks, reads=[(m.parse_hook("blocks.0.attn.z")[0], 7)])  # layer 7 of 2
        tp.forward(toks)  # still usable
