"""A Model pickles as a reference (issue 26): load arguments and a
fingerprint of its files, never its weights; unpickling loads it again and
refuses with dclens.Error if the files changed since it was loaded."""

import os
import pickle
import shutil
import warnings

import numpy as np
import pytest

import dclens
from dclens._core.reference import EDGE, WHOLE, ModelRef, fingerprint


@pytest.fixture
def model_dir(tiny_factory, tmp_path):
    d, sd, cfg = tiny_factory(model_type="dcpythia", seed=31)
    out = tmp_path / "m"
    shutil.copytree(d, out)
    return str(out)


def test_round_trip_is_the_same_model(model_dir):
    m = dclens.load(model_dir, n_threads=1)
    toks = np.arange(20, dtype=np.int32) % m.config.vocab
    blob = pickle.dumps(m)
    assert len(blob) < 4096  # a reference, not the weights
    m2 = pickle.loads(blob)
    assert m2 is not m and m2._m != m._m  # loaded again
    assert m2.reference() == m.reference()
    assert (m2.device, m2.path, m2.config) == (m.device, m.path, m.config)
    assert np.array_equal(m2.forward(toks), m.forward(toks))


def test_reference_holds_the_load_arguments(model_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(model_dir))
    m = dclens.load(os.path.basename(model_dir), n_threads=2, always_batch=True)
    r = m.reference()
    assert r.source == model_dir  # absolute: workers have another cwd
    assert (r.device, r.n_threads, r.always_batch) == ("cpu", 2, True)
    assert [f[0] for f in r.files] == ["config.json", "model.safetensors"]
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    assert dict((n, s) for n, s, h in r.files)["model.safetensors"] == size
    assert pickle.loads(pickle.dumps(m)).always_batch is True


def test_bundled_model_pickles_by_name():
    if "dcpythia-tiny" not in [b.name for b in dclens.bundled_models()]:
        pytest.skip("bundled models not installed")
    m = dclens.load("dcpythia-tiny", n_threads=1)
    assert m.reference().source == "dcpythia-tiny"
    assert pickle.loads(pickle.dumps(m)).reference().source == "dcpythia-tiny"


def test_sharded_checkpoints_fingerprint_every_shard(tiny_factory):
    d, sd, cfg = tiny_factory(model_type="gpt_neox", fmt="torch", shards=2, dtype="float16")
    names = [f[0] for f in fingerprint(d)]
    assert names[:2] == ["config.json", "pytorch_model.bin.index.json"]
    assert len(names) == 4 and all(n.endswith(".bin") for n in names[2:])


def _rewrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "change, said",
    [
        ("append", "model.safetensors: %d bytes, was %d"),
        ("header", "model.safetensors: its header or trailer changed (same size)"),
        ("config", "config.json"),
        ("remove", "model.safetensors is gone"),
    ],
)
def test_changed_files_are_refused(model_dir, change, said):
    m = dclens.load(model_dir, n_threads=1)
    blob = pickle.dumps(m)
    w = os.path.join(model_dir, "model.safetensors")
    size = os.path.getsize(w)
    if change == "append":
        with open(w, "ab") as f:
            f.write(b"\0" * 8)
        said = said % (size + 8, size)
    elif change == "header":
        with open(w, "rb") as f:
            head = f.read(64)
        _rewrite(w, 8, bytes([head[8] ^ 1]))  # one bit of the JSON header
    elif change == "config":
        with open(os.path.join(model_dir, "config.json"), "a") as f:
            f.write(" ")
    else:
        os.remove(w)
    with pytest.raises(dclens.Error) as e:
        pickle.loads(blob)
    assert model_dir in str(e.value) and said in str(e.value)
    assert "changed since it was loaded" in str(e.value)


def test_trailer_of_a_large_file_is_fingerprinted(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text("{}")
    blob = bytearray(os.urandom(WHOLE + 3 * EDGE))
    (d / "model.safetensors").write_bytes(bytes(blob))
    before = fingerprint(str(d))
    blob[len(blob) // 2] ^= 1  # the middle is not read
    (d / "model.safetensors").write_bytes(bytes(blob))
    assert fingerprint(str(d)) == before
    blob[-1] ^= 1  # the trailer is
    (d / "model.safetensors").write_bytes(bytes(blob))
    assert fingerprint(str(d)) != before


def test_gone_directory_is_an_error(model_dir):
    blob = pickle.dumps(dclens.load(model_dir, n_threads=1))
    shutil.rmtree(model_dir)
    with pytest.raises(dclens.Error, match="no such model directory"):
        pickle.loads(blob)


def test_hooks_and_caches_are_not_pickled(model_dir):
    m = dclens.load(model_dir, n_threads=1)
    m.weight("tok_embeddings.weight")  # fills the weight cache
    m.add_hook("blocks.0.attn.pattern", lambda a, n: None)
    with pytest.warns(UserWarning, match="not pickled"):
        blob = pickle.dumps(m)
    m2 = pickle.loads(blob)
    assert m2._ctx_hooks == [] and "_weights" not in m2.__dict__
    m.reset_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pickle.dumps(m)  # no hooks: no warning


def test_from_reference_refuses_other_objects():
    with pytest.raises(dclens.Error, match="ModelRef"):
        dclens.model.from_reference({"source": "x"})
    with pytest.raises(dclens.Error, match="no such model directory"):
        dclens.model.from_reference(ModelRef(source="/nonexistent/model"))
