"""scripts/train_bundled.py: one recipe for both twins, prepare and finish steps
(finish on generated tiny checkpoints standing in for trained ones)."""
import importlib.util
import json
import os

import numpy as np
import pytest
from conftest import ROOT, shared_path

import dcscope
from dcscope.testing.make_tiny import make_tiny
from synth_tasks.corpus import TOKENIZER_FILE


@pytest.fixture(scope="module")
def tb():
    spec = importlib.util.spec_from_file_location("train_bundled", os.path.join(ROOT, "scripts", "train_bundled.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_twins_share_everything_but_the_attention(tb):
    a, b = tb.config_for("dcpythia", 2209), tb.config_for("gpt_neox", 2209)
    assert (a["n_layer"], a["dim"], a["n_head"], a["intermediate_size"], a["vocab_size"]) == \
        (b["num_hidden_layers"], b["hidden_size"], b["num_attention_heads"], b["intermediate_size"],
         b["vocab_size"])
    assert a["rotary_pct"] == b["rotary_pct"] and a["use_dcmha"] and a["window_type"] is None
    assert a["tie_word_embeddings"] == b["tie_word_embeddings"]
    s = tb.schedule()
    assert s["steps"] * tb.RECIPE["tokens_per_step"] >= tb.RECIPE["tokens"] > 0


def test_prepare_writes_loadable_configs(tb, tmp_path):
    shared_path("data", "synthetic_dataset.jsonl")
    assert tb.main(["prepare", "--out", str(tmp_path)]) == 0
    for name, mtype in tb.TWINS.items():
        cfg = json.load(open(tmp_path / name / "config.json"))
        assert cfg["model_type"] == mtype and cfg["vocab_size"] == 2209
        assert (tmp_path / name / "tokenizer.json").read_bytes() == open(TOKENIZER_FILE, "rb").read()
    assert json.load(open(tmp_path / "recipe.json"))["schedule"] == tb.schedule()
    # the trainer is not in this checkout: train says so instead of pretending
    assert tb.main(["train", "--out", str(tmp_path)]) == 2


def test_finish_benchmarks_the_stored_weights_and_writes_cards(tb, tmp_path, monkeypatch):
    shared_path("data", "synthetic_dataset.jsonl")
    for name, mtype in tb.TWINS.items():
        make_tiny(str(tmp_path / name), mtype, vocab=2209, tokenizer=TOKENIZER_FILE, seed=5)
        (tmp_path / name / "loss.csv").write_text("step,tokens,loss\n0,0,7.7\n10,81920,5.0\n")
    assert tb.main(["finish", "--out", str(tmp_path), "--limit", "3", "--command", "CMD"]) == 0
    for name in tb.TWINS:
        ship = tmp_path / "ship" / name
        assert sorted(os.listdir(ship)) == ["MODEL_CARD.md", "config.json", "loss.csv", "loss.png",
                                            "model.safetensors", "tokenizer.json"]
        assert json.load(open(ship / "config.json"))["torch_dtype"] == "float16"
        m32, m16 = dcscope.load(str(tmp_path / name)), dcscope.load(str(ship))
        toks = m16.to_tokens("\n< Ruth has a taxi. >. Ruth does not have a kind of vehicle\n")
        assert np.allclose(m16.forward(toks), m32.forward(toks), atol=0.05)
        res = json.load(open(tmp_path / "bench" / "published" / name / "results.json"))
        card = (ship / "MODEL_CARD.md").read_text()
        assert res["model_dir"] == str(ship) and res["lines"] == 3
        assert "| %s (published) |" % name in card and "CMD" in card and "loss.png" in card
    monkeypatch.setenv(dcscope.bundled.ENV, str(tmp_path / "ship"))
    assert [m.name for m in dcscope.bundled_models()] == sorted(tb.TWINS)
