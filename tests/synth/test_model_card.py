"""synth_tasks.model_card on results.json files written by `dclens synth` on a tiny model."""

import json

import pytest

from dclens._core.bundled import _summary
from dclens.cli.commands import main as cli_main
from dclens.testing.make_tiny import make_tiny
from synth_tasks.corpus import TOKENIZER_FILE
from synth_tasks.model_card import CardError, _pct, _ppl, model_card, read_train_log
from synth_tasks.model_card import main as card_main

from conftest import shared_path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("card")
    make_tiny(str(d / "m"), "dcpythia", vocab=2209, tokenizer=TOKENIZER_FILE)
    pub = shared_path("data", "synthetic_dataset.jsonl")
    for label, data in (("pub", pub), ("held", "heldout")):
        assert (
            cli_main(
                [
                    "synth",
                    "--model",
                    str(d / "m"),
                    "--data",
                    data,
                    "--limit",
                    "20",
                    "--no-plots",
                    "--no-progress",
                    "--out",
                    str(d / label),
                ]
            )
            == 0
        )
    log = d / "loss.csv"
    log.write_text(
        "step,tokens,loss,lr,elapsed_s\n0,0,7.71,0.0,0.0\n10,40960,5.5,0.001,8.0\n20,81920,4.25,0.0009,16.0\n"
    )
    return d


def test_card_from_synth_results(run, tmp_path):
    out = tmp_path / "MODEL_CARD.md"
    assert (
        card_main(
            [
                str(out),
                "--name",
                "dc-tiny",
                "--results",
                f"published={run / 'pub' / 'results.json'}",
                "--results",
                f"held-out={run / 'held' / 'results.json'}",
                "--train-log",
                str(run / "loss.csv"),
                "--model-dir",
                str(run / "m"),
                "--command",
                "dclens train --seed 3",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    card = out.read_text()
    pub = json.loads((run / "pub" / "results.json").read_text())
    held = json.loads((run / "held" / "results.json").read_text())
    ov = pub["overall"]
    row = f"| dc-tiny (published) | {_pct(ov['acc'])} | {_ppl(ov['ppl'])} | {ov['n']} |"
    assert row in card
    assert f"| dc-tiny (held-out) | {_pct(held['overall']['acc'])} | {_ppl(held['overall']['ppl'])} |" in card
    assert "| Pythia-6.9B (paper, published) | 31.9% | 10.05 | 5328 |" in card
    assert "| DCPythia-6.9B (paper, published) | 39.0% | 7.36 | 5328 |" in card
    for k in pub["per_k"]:
        assert f"\n| {k} | {_pct(pub['per_k'][k]['acc'])} |" in card
    for p in pub["per_pattern"]:
        assert f"\n| {p} |" in card
    for t in held["per_transform"]:
        assert f"\n| {t} |" in card
    for tid, s in pub["per_task"].items():
        assert f"\n| {tid} | {s['pattern'] or '-'} | {s['transform'] or '-'} | {_pct(s['acc'])} |" in card
    assert "dclens train --seed 3" in card and "Seed: 3" in card
    assert "| loss, last logged | 4.2500 |" in card and "| tokens | 81,920 |" in card
    summary = _summary(str(out))
    assert summary.startswith("A 0.") and "DCPythia (DCMHA), trained on 81,920 tokens" in summary
    assert f"accuracy {_pct(ov['acc'])}" in summary and "39.0% / 7.36" in summary


def test_card_bad_inputs(run, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text('{"model": "x"}')
    with pytest.raises(CardError, match="no 'overall'"):
        model_card("x", {"published": str(bad)})
    log = tmp_path / "l.csv"
    log.write_text("step,acc\n1,2\n")
    with pytest.raises(CardError, match="'step' and 'loss'"):
        read_train_log(log)
    log.write_text("step,loss\n1,abc\n")
    with pytest.raises(CardError, match="not a number"):
        read_train_log(log)
    with pytest.raises(CardError, match="at least one"):
        model_card("x", {})
    assert card_main([str(tmp_path / "c.md"), "--name", "x", "--results", f"p={tmp_path / 'none.json'}"]) == 2
