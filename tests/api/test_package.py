"""Issue 21: the package behaves like its neighbours.

Hub ids from a Hugging Face cache laid out on disk (network off), Error
subclasses that are the builtins they mean, did-you-mean for names, the
TransformerLens habits (HookPoint, from_pretrained, cfg, prepend_bos, cache
methods), the context warning, the progress helper, and the command line
(python -m dclens, --version, help and defaults on every option)."""

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dclens
from dclens import progress as P

from conftest import rel_err
from reference import ref_forward

TOL = 1e-4


# ---------------------------------------------------------------- Hub ids


def _lay_out_snapshot(cache, repo_id, commit, src_dir, refs=()):
    """A Hugging Face cache entry as huggingface_hub writes it: blobs named by
    their hash, snapshots/<commit>/<file> symlinks to them, refs/<name>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(os.listdir(src_dir)):
        data = Path(src_dir, f).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f)
    (repo / "refs").mkdir(exist_ok=True)
    for r in refs:
        (repo / "refs" / r).write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, tiny_factory, monkeypatch):
    """A cache with org/tiny at two commits (main -> the second, tag v1 -> the first)."""
    a = tiny_factory(model_type="dcpythia", seed=11)
    b = tiny_factory(model_type="gpt_neox", seed=12)
    cache = tmp_path / "hub"
    c1, c2 = "1" * 40, "2" * 40
    _lay_out_snapshot(cache, "org/tiny", c1, a[0], refs=["v1"])
    _lay_out_snapshot(cache, "org/tiny", c2, b[0], refs=["main"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*a, **k):
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return {"main": b, "v1": a, c1: a, c2: b}


def test_hub_id_loads_from_the_cache_with_the_network_off(hub_cache):
    toks = np.arange(9) % 50
    m = dclens.load("org/tiny")
    assert m.name == "org/tiny" and m.cfg.model_name == "org/tiny"
    _, sd, cfg = hub_cache["main"]
    assert rel_err(m.forward(toks), ref_forward(sd, cfg, toks)) <= TOL
    for rev in ("v1", "1" * 40):
        m = dclens.from_pretrained("org/tiny", revision=rev)
        _, sd, cfg = hub_cache[rev]
        assert m.config.model_type == cfg["model_type"] == "dcpythia"
        assert rel_err(m.forward(toks), ref_forward(sd, cfg, toks)) <= TOL


def test_hub_id_not_cached_offline_is_file_not_found(hub_cache):
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE") as ei:
        dclens.load("org/absent")
    assert isinstance(ei.value, dclens.Error) and "org/absent" in str(ei.value)
    with pytest.raises(dclens.NotFoundError, match="revision 'v9'"):
        dclens.load("org/tiny", revision="v9")
    with pytest.raises(ValueError, match="revision"):
        dclens.load("dcpythia-tiny", revision="main")  # a bundled name has no revisions


# ---------------------------------------------------------------- errors, names


def test_errors_are_the_builtins_they_mean(tmp_path):
    m = dclens.load("dcpythia-tiny")
    with pytest.raises(FileNotFoundError):
        dclens.load(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError):
        dclens.load("dcpythia-tiny", device="tpu")
    with pytest.raises(TypeError):
        dclens.interventions.ablate_head(m, layer=0.5, head=0)
    with pytest.raises(ValueError):
        m.forward(np.array([1, 2]), logits_at=5)
    with pytest.raises(KeyError):
        m.run_with_cache("The cat", names=["blocks.0.attn.patern"])
    _, c = m.run_with_cache("The cat", names=["embed"])
    with pytest.raises(KeyError):
        c["blocks.0.attn.pattern"]
    for cls in (FileNotFoundError, ValueError, TypeError, KeyError):
        assert issubclass(
            {
                FileNotFoundError: dclens.NotFoundError,
                ValueError: dclens.ArgumentError,
                TypeError: dclens.ArgumentTypeError,
                KeyError: dclens.UnknownNameError,
            }[cls],
            (cls, dclens.Error),
        )


def test_did_you_mean_names_an_installed_source():
    m = dclens.load("dcpythia-tiny")
    with pytest.raises(dclens.UnknownNameError) as ei:
        m.run_with_hooks("The cat", [("blocks.1.attn.patern", lambda a, h: None)])
    e = ei.value
    assert e.suggestions[0] == "blocks.1.attn.pattern" and "did you mean 'blocks.1.attn.pattern'" in str(e)
    assert "dclens.hook_names(model)" in str(e) and "shared/docs" not in str(e)
    assert str(e) == e.args[0]  # not KeyError's quoted repr
    assert "blocks.1.attn.pattern" in dclens.hook_names(m)
    with pytest.raises(KeyError, match=r"did you mean 'layers\.0\.attention\.wo\.weight'") as ei:
        m.weight("layers.0.attention.wo.weigth")
    assert "model.weight_names()" in str(ei.value)
    with pytest.raises(dclens.UnknownNameError, match="layer 7 is out of range"):
        m.run_with_cache("The cat", names=["blocks.7.attn.pattern"])


# ---------------------------------------------------------------- TransformerLens habits


def test_hook_functions_get_a_hookpoint_with_name():
    m = dclens.load("dcpythia-tiny")
    seen = []

    def fn(act, hook):
        seen.append((hook, hook.name, hook.layer(), hook.tl_name, hook == "blocks.2.attn.pattern"))

    m.run_with_hooks("The cat sat", [("blocks.2.attn.hook_pattern", fn), ("embed", dclens.read_only(fn))])
    (h2, n2, l2, tl2, eq2), (he, ne, le, tle, _) = sorted(seen, key=lambda s: s[2] is None)
    assert isinstance(h2, str) and isinstance(h2, dclens.HookPoint) and type(n2) is str
    assert (n2, l2, tl2, eq2) == ("blocks.2.attn.pattern", 2, "blocks.2.attn.hook_pattern", True)
    assert (ne, le, tle) == ("embed", None, "hook_embed")


def test_cfg_has_transformerlens_field_names():
    m = dclens.load("dcpythia-tiny")
    cfg, raw = m.cfg, json.loads(Path(m.path, "config.json").read_text())
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == (
        raw["n_layer"],
        raw["dim"],
        raw["n_head"],
        raw["head_dim"],
        raw["intermediate_size"],
        raw["vocab_size"],
    )
    assert cfg.n_ctx == raw["max_position_embeddings"] == 288
    assert cfg["act_fn"] == "gelu" and cfg.positional_embedding_type == "rotary" and cfg.parallel_attn_mlp
    assert cfg.attn_types == ("local", "global", "local", "global") and cfg.window_size == raw["window_size"]
    assert cfg.default_prepend_bos is False and dclens.Model.from_pretrained is dclens.from_pretrained


def test_prepend_bos():
    m = dclens.load("pythia-tiny")
    plain = m.to_tokens("The cat")
    bos = m.to_tokens("The cat", prepend_bos=True)
    assert bos[0] == m.cfg.bos_token_id == 0 and np.array_equal(bos[1:], plain)
    np.testing.assert_array_equal(m.forward("The cat", prepend_bos=True), m.forward(bos))
    toks, lens = m.to_tokens(["a b", "The cat sat"], prepend_bos=True)
    assert (toks[:, 0] == 0).all() and list(lens) == [len(m.to_tokens("a b")) + 1, len(m.to_tokens("The cat sat")) + 1]
    mb = dclens.load("pythia-tiny", prepend_bos=True)
    assert mb.cfg.default_prepend_bos and np.array_equal(mb.to_tokens("The cat"), bos)


def test_prompt_longer_than_the_trained_context_warns():
    m = dclens.load("dcpythia-tiny")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m.forward(np.zeros(m.cfg.n_ctx, np.int32))
        assert not [x for x in w if issubclass(x.category, dclens.ContextWarning)]
        m.forward(np.zeros(m.cfg.n_ctx + 1, np.int32), logits_at="last")
    ws = [x for x in w if issubclass(x.category, dclens.ContextWarning)]
    assert len(ws) == 1 and "289 tokens" in str(ws[0].message) and "288-token context" in str(ws[0].message)
    assert ws[0].filename == __file__  # points at the user's call


def test_cache_methods_of_transformerlens():
    m = dclens.load("dcpythia-tiny")
    toks = m.to_tokens("When Mary and John went to the store")
    _, c1 = m.run_with_cache(toks)
    _, cb = m.run_with_cache(toks[None])
    assert cb.has_batch_dim and cb.remove_batch_dim() is cb and not cb.has_batch_dim
    np.testing.assert_array_equal(cb["blocks.1.attn.pattern"], c1["blocks.1.attn.pattern"])
    _, c2 = m.run_with_cache(np.stack([toks, toks]))
    with pytest.raises(ValueError, match="batch of 2"):
        c2.remove_batch_dim()
    st = c1.stack_activation("pattern")
    assert st.shape == (4,) + c1["blocks.0.attn.pattern"].shape
    np.testing.assert_array_equal(st[3], c1["blocks.3.attn.pattern"])
    assert c1.stack_activation("resid_post", layer=2).shape[0] == 2
    # the full decomposition sums to the residual; its parts are what they say
    L, N, F = m.cfg.n_layers, m.cfg.n_heads, m.cfg.d_mlp
    full, labels = c1.get_full_resid_decomposition(return_labels=True)
    assert full.shape[0] == len(labels) == L * N + L * F + 2 and labels[-2:] == ["embed", "bias"]
    resid = np.asarray(c1["blocks.3.resid_post"], np.float64)
    assert rel_err(full.sum(0), resid) <= 1e-5
    np.testing.assert_allclose(full[labels.index("L2H3")], c1["blocks.2.attn.head_out"][:, 3], rtol=0, atol=0)
    i = labels.index("L1N7")
    np.testing.assert_allclose(
        full[i], np.outer(np.float64(c1["blocks.1.mlp.post"][:, 7]), np.float64(m.W_out[1][7])), rtol=1e-12
    )
    part = c1.get_full_resid_decomposition(layer=2, expand_neurons=False, pos_slice=-1)
    assert rel_err(part.sum(0), np.asarray(c1["blocks.2.resid_pre"], np.float64)[-1]) <= 1e-5


# ---------------------------------------------------------------- progress


def test_progress_in_a_log_is_a_few_plain_lines(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert P.mode(None) == "lines" and P.mode(False) == "none" and P.mode(True) == "bar"
    for _ in P.bar(range(1000), desc="sweep", progress=None):
        pass
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue() and len(lines) == 5, lines  # start, 25/50/75 %, done
    assert lines[0] == "sweep: start" and lines[1].startswith("sweep: 25% (250/1000") and "done" in lines[-1]
    # a resumed run (initial 800 of 1300) reports only the quarters still ahead
    err.seek(0)
    err.truncate(0)
    b = P.bar(total=1300, initial=800, desc="train", progress=None)
    b.update(1)
    b.update(199)
    b.close()
    lines = err.getvalue().splitlines()
    assert lines[0] == "train: resumed at 800" and lines[1].startswith("train: 75% (1000/1300"), lines
    assert len(lines) == 3 and "done" in lines[-1], lines
    # a jump over two quarters says its count once (issue 41: "25% (12/24)" then "50% (12/24)")
    err.seek(0)
    err.truncate(0)
    b = P.bar(total=24, desc="eval", progress=None)
    b.update(12)
    b.update(12)
    b.close()
    lines = err.getvalue().splitlines()
    assert [x.split(" ")[1:3] for x in lines[1:-1]] == [["50%", "(12/24"], ["75%", "(24/24"]], lines
    err.seek(0)
    err.truncate(0)
    b = P.bar(total=10, desc="x", progress=False)
    b.update(10)
    b.close()
    assert err.getvalue() == ""
    with pytest.raises(TypeError):
        P.bar(total=3, progress="yes")


def test_progress_bar_is_tqdm_auto_and_every_slow_call_takes_progress(monkeypatch):
    import inspect

    from tqdm.auto import tqdm as auto

    b = P.bar(total=2, progress=True, file=io.StringIO())
    assert isinstance(b, auto)
    b.close()
    from dclens import analysis, attribution, patching, train
    from synth_tasks.evaluate import evaluate as synth_evaluate

    for fn in (
        analysis.iter_dataset,
        analysis.head_output_pca,
        analysis.head_similarity,
        analysis.composition_stats,
        analysis.head_load,
        patching.sweep,
        attribution.attribute,
        dclens.Model.attribute,
        synth_evaluate,
        dclens.load,
    ):
        assert "progress" in inspect.signature(fn).parameters, fn
        assert inspect.signature(fn).parameters["progress"].default is None, fn
    assert "progress" in {f.name for f in __import__("dataclasses").fields(train.TrainConfig)}


# ---------------------------------------------------------------- command line


def test_python_m_dclens_version_and_help():
    out = subprocess.run([sys.executable, "-m", "dclens", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "dclens %s" % dclens.__version__
    h = subprocess.run([sys.executable, "-m", "dclens", "--help"], capture_output=True, text=True)
    assert h.returncode == 0
    for cmd in ("heatmap", "info", "models", "make-tiny", "train", "synth"):
        assert cmd in h.stdout


def test_every_option_has_help_and_shows_its_default():
    import argparse

    from dclens import cli

    ps = cli.parsers()
    assert set(ps) >= {"heatmap", "info", "models", "make-tiny", "train", "synth"}
    for name, p in ps.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, "%s %s has no help" % (name, a.option_strings or a.dest)
            text = p.format_help()
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) and not a.required:
                shown = p._get_formatter()._get_help_string(a)
                assert "default" in shown, "%s %s: default %r not shown" % (name, a.option_strings, a.default)
            assert (a.option_strings[0] if a.option_strings else a.metavar or a.dest) in text or a.dest in text
        assert "(default: None)" not in p.format_help(), name


def test_py_typed_is_shipped():
    assert os.path.exists(os.path.join(os.path.dirname(dclens.__file__), "py.typed"))
