"""synth_tasks.composition: the composition effect is exactly zero without
composition (so the mask and softmax match the engine's) and picks a line otherwise."""

import pytest

import dclens
from dclens.testing.make_tiny import make_tiny
from synth_tasks import load_dataset
from synth_tasks.composition import composition_effect, most_composed
from synth_tasks.composition import main as comp_main
from synth_tasks.corpus import HELDOUT_FILE, TOKENIZER_FILE

from tolerances import f32_tol


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("comp")
    kw = dict(vocab=2209, tokenizer=TOKENIZER_FILE, n_layer=2, window_size=8)
    make_tiny(str(d / "identity"), "dcpythia", dyn_scale=0.0, **kw)  # C = I: no composition
    make_tiny(str(d / "dc"), "dcpythia", **kw)
    make_tiny(str(d / "mha"), "gpt_neox", **kw)
    return d


@pytest.fixture(scope="module")
def lines():
    return load_dataset(HELDOUT_FILE, limit=6).lines


def test_zero_without_composition(models, lines):
    m = dclens.load(str(models / "identity"))
    assert m.config.local_layers == (0,)  # the window mask is exercised
    ids = m.to_tokens(lines[0].text)
    eff = composition_effect(m, ids, range(len(ids)))
    # identity composition: the effect is float32 rounding of an N-term map
    # product on weights <= 1 (tests/tolerances.py)
    assert eff.shape == (2, 4, len(ids)) and eff.max() <= f32_tol(4, 2, eff.size, sides=2)


def test_picks_the_most_composed_answer(models, lines, tmp_path, capsys):
    m = dclens.load(str(models / "dc"))
    pick = most_composed(m, lines)
    assert pick["effect"] > 0.1 and pick["effect"] >= pick["mean_effect"]
    line = lines[pick["index"]]
    assert line.text.startswith(pick["text"]) and pick["text"].endswith(pick["answer"])
    ids = m.to_tokens(line.text)
    eff = composition_effect(m, ids, [pick["query_position"]])
    assert eff[pick["layer"], pick["head"], 0] == pytest.approx(pick["effect"])
    out = tmp_path / "t.txt"
    assert comp_main(["--model", str(models / "dc"), "--lines", "6", "--text-out", str(out)]) == 0
    assert out.read_text() == pick["text"]
    with pytest.raises(ValueError, match="no composition"):
        composition_effect(dclens.load(str(models / "mha")), ids, [3])
    assert comp_main(["--model", str(models / "mha"), "--lines", "2"]) == 2
