"""scripts/train_bundled.py: one recipe for both twins, prepare and finish steps
(finish on generated tiny checkpoints standing in for trained ones)."""

import json
import os
from pathlib import Path

import dclens
from dclens.testing.make_tiny import make_tiny
from synth_tasks.corpus import TOKENIZER_FILE

from conftest import ROOT, rel_err, shared_path
from tolerances import U16, U32, forward_tol, tiny


def test_twins_share_everything_but_the_attention(tb):
    a, b = tb.config_for("dcpythia", 2209), tb.config_for("gpt_neox", 2209)
    assert (a["n_layer"], a["dim"], a["n_head"], a["intermediate_size"], a["vocab_size"]) == (
        b["num_hidden_layers"],
        b["hidden_size"],
        b["num_attention_heads"],
        b["intermediate_size"],
        b["vocab_size"],
    )
    assert a["rotary_pct"] == b["rotary_pct"] and a["use_dcmha"] and a["window_type"] is None
    assert a["tie_word_embeddings"] == b["tie_word_embeddings"]
    s = tb.schedule()
    assert s["steps"] * tb.RECIPE["tokens_per_step"] >= tb.RECIPE["tokens"] > 0


def test_prepare_writes_loadable_configs(tb, tmp_path):
    shared_path("data", "synthetic_dataset.jsonl")
    assert tb.main(["prepare", "--out", str(tmp_path)]) == 0
    for name, mtype in tb.TWINS.items():
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["model_type"] == mtype and cfg["vocab_size"] == 2209
        assert (tmp_path / name / "tokenizer.json").read_bytes() == Path(TOKENIZER_FILE).read_bytes()
    assert json.loads((tmp_path / "recipe.json").read_text())["schedule"] == tb.schedule()
    # train --dry-run prints the corpus command and both twins' commands, runs nothing
    assert tb.main(["train", "--out", str(tmp_path), "--dry-run"]) == 0
    assert not (tmp_path / "train.jsonl").exists()


def test_finish_benchmarks_the_stored_weights_and_writes_cards(tb, tmp_path, monkeypatch):
    shared_path("data", "synthetic_dataset.jsonl")
    for name, mtype in tb.TWINS.items():
        make_tiny(str(tmp_path / name), mtype, vocab=2209, tokenizer=TOKENIZER_FILE, seed=5)
        (tmp_path / name / "loss.csv").write_text("step,tokens,loss\n0,0,7.7\n10,81920,5.0\n")
    assert tb.main(["finish", "--out", str(tmp_path), "--limit", "3", "--command", "CMD"]) == 0
    for name in tb.TWINS:
        ship = tmp_path / "ship" / name
        assert sorted(os.listdir(ship)) == [
            "MODEL_CARD.md",
            "benchmark.json",
            "config.json",
            "loss.csv",
            "loss.png",
            "model.safetensors",
            "tokenizer.json",
        ]
        bench = json.loads((ship / "benchmark.json").read_text())
        assert sorted(bench) == ["held-out", "published"] and bench["published"]["lines"] == 3
        assert json.loads((ship / "config.json").read_text())["torch_dtype"] == "float16"
        m32, m16 = dclens.load(str(tmp_path / name)), dclens.load(str(ship))
        toks = m16.to_tokens("\n< Ruth has a taxi. >. Ruth does not have a kind of vehicle\n")
        # the shipped weights are the float32 ones rounded to float16 (unit
        # roundoff U16 = 2^-11 each): the error model of tests/tolerances.py with
        # U16 in place of U32, for this model's depth and widths (make_tiny's)
        l32 = m32.forward(toks)
        f16 = forward_tol(tiny(), len(toks), l32.size) * U16 / U32
        assert rel_err(m16.forward(toks), l32) <= f16
        res = json.loads((tmp_path / "bench" / "published" / name / "results.json").read_text())
        card = (ship / "MODEL_CARD.md").read_text()
        assert res["model_dir"] == str(ship) and res["lines"] == 3
        assert bench["published"]["overall"] == res["overall"]
        assert "| %s (published) |" % name in card and "CMD" in card and "loss.png" in card
    monkeypatch.setenv(dclens.bundled.ENV, str(tmp_path / "ship"))
    assert [m.name for m in dclens.bundled_models()] == sorted(tb.TWINS)


def test_train_commands_are_identical_but_for_the_attention(tb, tmp_path):
    """The two twins' `dclens train` commands differ only in --out and --model-type."""
    a, b = tb.train_commands(str(tmp_path), seed=0)
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b)
    assert [x for x, _ in diff] == [str(tmp_path / "dcpythia-tiny"), "dcpythia"]
    assert [y for _, y in diff] == [str(tmp_path / "pythia-tiny"), "gpt_neox"]
    assert "--lines" in a and a[a.index("--steps") + 1] == str(tb.RECIPE["steps"])


def test_recipe_reproduces_the_start_of_the_shipped_curve(tb, tmp_path):
    """The bundled twins' training command, rerun for two steps, gives the first two losses of the
    shipped loss.csv (same data file, seed and single thread: the run is deterministic)."""
    import csv
    import subprocess
    import sys

    data = tmp_path / "train.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "synth_tasks.cli",
            "corpus",
            "train",
            str(data),
            "--lines",
            str(tb.RECIPE["train_lines"]),
            "--seed",
            str(tb.RECIPE["train_stream_seed"]),
            "--format",
            "jsonl",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    for cmd, name in zip(tb.train_commands(str(tmp_path), tb.RECIPE["init_seeds"][0], 1), tb.TWINS):
        cmd = [sys.executable] + cmd[1:] + ["--stop-after", "2", "--no-progress"]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        ship = next(m.path for m in dclens.bundled_models() if m.name == name)
        with open(os.path.join(ship, "loss.csv")) as f:
            want = list(csv.DictReader(f))[:2]
        with open(tmp_path / name / "loss.csv") as f:
            got = list(csv.DictReader(f))
        assert [r["step"] for r in got] == ["1", "2"]
        for g, w in zip(got, want):
            # loss.csv holds 6 decimals (%.6f: 5e-7 each side), and the same
            # command on another CPU / BLAS kernel changes the float32 pass:
            # forward_tol relative to the logits, which at step 1-2 are
            # within +-LOGIT_MAX (N(0, 0.02) unembedding of unit-variance rows of D 192, 6 sigma)
            LOGIT_MAX = 6 * 0.02 * 192**0.5
            tol = (
                1e-6
                + 2
                * forward_tol(dict(dim=192, intermediate_size=768, n_layer=4), 288, 40 * 288 * 2209, sides=2)
                * LOGIT_MAX
            )
            assert abs(float(g["loss"]) - float(w["loss"])) <= tol, (name, g, w)
            assert g["lr"] == w["lr"]


def test_small_pair_is_the_same_recipe_wider_and_deeper(tb):
    """The larger pair (issue 29): 6 layers, d_model 256, 8 heads (head_dim 32 as the tiny twins),
    trained on the GPU; everything else is the tiny twins' recipe, and its commands differ from
    each other only in --out and --model-type."""
    tiny = dict(tb.RECIPE)
    tb.use_pair("small")
    try:
        small, twins = dict(tb.RECIPE), dict(tb.TWINS)
        a, b = tb.train_commands("RUN", seed=0, n_threads=8)
    finally:
        tb.use_pair("tiny")
    assert twins == {"dcpythia-small": "dcpythia", "pythia-small": "gpt_neox"}
    changed = {k for k in small if small[k] != tiny.get(k)}
    assert changed == {
        "n_layer",
        "dim",
        "n_head",
        "intermediate",
        "tokens",
        "steps",
        "train_lines",
        "checkpoint_every_steps",
        "ckpt_every",
        "init_seeds",
        "device",
    }
    assert (small["n_layer"], small["dim"], small["n_head"], small["intermediate"]) == (6, 256, 8, 1024)
    assert small["dim"] // small["n_head"] == tiny["dim"] // tiny["n_head"]
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert diff == [
        (os.path.join("RUN", "dcpythia-small"), os.path.join("RUN", "pythia-small")),
        ("dcpythia", "gpt_neox"),
    ]
    opt = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--")}
    assert opt["--device"] == "cuda" and opt["--steps"] == str(small["steps"]) and opt["--n-layer"] == "6"
    assert tb.RECIPE == tiny  # use_pair("tiny") restored the bundled recipe


def test_main_options_leave_the_tiny_recipe_in_place(tb, tmp_path, capsys):
    """--pair / --steps / --device / --parallel / --stop-after reach the printed commands, and the
    module's recipe is the tiny twins' again afterwards (the tests share one module)."""
    argv = ["train", "--pair", "small", "--out", str(tmp_path), "--dry-run", "--steps", "7", "--device", "cpu"]
    assert tb.main(argv + ["--stop-after", "3", "--parallel"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "--lines 160000" in lines[0]
    for ln in lines[1:]:
        w = ln.split()
        assert w[w.index("--steps") + 1] == "7" and w[w.index("--stop-after") + 1] == "3"
        assert "--device" not in w and "--no-progress" in w and w[w.index("--n-layer") + 1] == "6"
    assert tb.PAIR == "tiny" and tb.RECIPE["n_layer"] == 4 and tb.RECIPE["steps"] == 1300
    assert list(tb.TWINS) == ["dcpythia-tiny", "pythia-tiny"]


def test_small_pair_budget_counts_the_other_bundled_models(tb, tmp_path, monkeypatch):
    """The larger pair's 60 MB is a total: finish adds the bundled models that are not this pair."""
    root = tmp_path / "root"
    other = root / "bindings" / "dclens" / "models" / "dcpythia-tiny"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"x" * 1000)
    (root / "bindings" / "dclens" / "models" / "pythia-small").mkdir()
    ((root / "bindings" / "dclens" / "models" / "pythia-small") / "model.safetensors").write_bytes(b"y" * 500)
    monkeypatch.setattr(tb, "ROOT", str(root))
    tb.use_pair("small")
    try:
        assert tb._other_bundled_bytes() == 1000  # the pair's own directories are not counted
    finally:
        tb.use_pair("tiny")
