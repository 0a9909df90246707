"""dclens.bundled_models / load by name, against a temporary models directory
(DCLENS_MODELS_DIR) holding generated tiny checkpoints."""

import fnmatch
import os
import subprocess
import sys

import numpy as np
import pytest

import dclens
from dclens import bundled
from dclens.cli.commands import main as cli_main
from dclens.testing.make_tiny import make_tiny
from synth_tasks.corpus import TOKENIZER_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    make_tiny(str(d / "dc-tiny"), "dcpythia", vocab=2209, tokenizer=TOKENIZER_FILE, n_layer=2)
    make_tiny(str(d / "mha-tiny"), "gpt_neox", vocab=2209, tokenizer=TOKENIZER_FILE, n_layer=2)
    (d / "dc-tiny" / "MODEL_CARD.md").write_text("# dc-tiny\n\nA tiny DCPythia\nfor tests.\n\n## Results\n\nnone\n")
    (d / "not-a-model").mkdir()  # no config.json: not listed
    (d / "README.txt").write_text("x")
    return d


@pytest.fixture
def env(models, monkeypatch):
    monkeypatch.setenv(bundled.ENV, str(models))
    return models


def test_registry_lists_what_is_on_disk(env):
    ms = dclens.bundled_models()
    assert [m.name for m in ms] == ["dc-tiny", "mha-tiny"]
    assert [m.model_type for m in ms] == ["dcpythia", "gpt_neox"]
    assert ms[0].summary == "A tiny DCPythia for tests." and ms[1].summary == ""
    assert ms[0].path == str(env / "dc-tiny")
    assert dclens.bundled_models(env / "nope") == []


def test_load_by_name_equals_load_by_path(env):
    a = dclens.load("dc-tiny")
    b = dclens.load(str(env / "dc-tiny"))
    assert a.name == "dc-tiny" and a.config.model_type == "dcpythia"
    toks = a.to_tokens("\n< Ruth has a taxi. >. Ruth does not have a kind of vehicle\n")
    assert np.array_equal(a.forward(toks), b.forward(toks))
    assert dclens.load("mha-tiny").config.model_type == "gpt_neox"
    c = dclens.load(dclens.bundled_models()[0])  # what bundled_models() lists loads as it is
    assert c.name == "dc-tiny" and np.array_equal(c.forward(toks), b.forward(toks))


def test_unknown_name_lists_bundled_names(env, tmp_path):
    with pytest.raises(dclens.Error) as ei:
        dclens.load("dcpythia-huge")
    msg = str(ei.value)
    assert "dcpythia-huge" in msg and "config.json" in msg and "dc-tiny, mha-tiny" in msg
    with pytest.raises(dclens.Error, match="none installed"):
        bundled.resolve("dc-tiny", tmp_path / "empty")
    # a path with a separator is never looked up as a name
    with pytest.raises(dclens.Error, match="no such model directory"):
        dclens.load(os.path.join("sub", "dc-tiny"))
    # an existing directory wins over a bundled name
    assert bundled.resolve(str(env / "dc-tiny")) == str(env / "dc-tiny")


def test_default_registry_is_the_package_directory(monkeypatch):
    monkeypatch.delenv(bundled.ENV, raising=False)
    assert bundled.models_dir() == os.path.join(os.path.dirname(dclens.__file__), "models")
    # whatever is installed there is listed (nothing, until trained models are committed)
    for m in dclens.bundled_models():
        assert os.path.isfile(os.path.join(m.path, "config.json"))


def test_package_data_covers_a_bundled_model_directory():
    # scikit-build-core installs every file of the wheel.packages directories
    # except those wheel.exclude names: a bundled model's files must survive it
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        sk = tomllib.load(f)["tool"]["scikit-build"]
    assert "bindings/dclens" in sk["wheel"]["packages"] and "synth_tasks" in sk["wheel"]["packages"]
    excluded = sk["wheel"].get("exclude", [])
    wanted = [
        "dclens/models/dcpythia-tiny/" + fn
        for fn in ["model.safetensors", "config.json", "tokenizer.json", "MODEL_CARD.md"]
    ]
    wanted += ["synth_tasks/data/heldout.jsonl", "synth_tasks/data/tokenizer.json"]
    for path in wanted:
        assert not any(fnmatch.fnmatch(path, g) for g in excluded), (path, excluded)
    assert any(fnmatch.fnmatch("dclens/__pycache__/model.cpython-311.pyc", g) for g in excluded)


def test_every_model_option_takes_a_bundled_name(env, tmp_path, capsys):
    assert cli_main(["info", "--model", "dc-tiny"]) == 0
    assert "dcpythia" in capsys.readouterr().out
    out = tmp_path / "h.png"
    assert (
        cli_main(["heatmap", "--model", "mha-tiny", "--text", "Ruth has a taxi", "--layer", "0", "--out", str(out)])
        == 0
    )
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "dc-tiny" in listing and "A tiny DCPythia for tests." in listing
    assert (
        cli_main(
            [
                "synth",
                "--model",
                "dc-tiny",
                "--model",
                "mha-tiny",
                "--data",
                "heldout",
                "--limit",
                "2",
                "--no-plots",
                "--no-progress",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    assert (tmp_path / "s" / "dc-tiny" / "results.json").is_file()
    assert (tmp_path / "s" / "mha-tiny" / "results.json").is_file()
    assert cli_main(["info", "--model", "nope-tiny"]) == 1
    assert "bundled models: dc-tiny, mha-tiny" in capsys.readouterr().err


def test_core_package_does_not_import_synth_tasks():
    code = "import sys, dclens; dclens.bundled_models(); print('synth_tasks' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"
