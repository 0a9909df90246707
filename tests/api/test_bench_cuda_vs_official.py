"""scripts/bench_cuda_vs_official.py without torch: its dclens side (the worker) on a tiny CPU
checkpoint, the differences and the table it reports, its budget helpers. The official module's
side needs torch and runs on the GPU machine (scripts/gpu_check.sh) or in a torch venv (--tiny)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(ROOT, "scripts", "bench_cuda_vs_official.py")
    spec = importlib.util.spec_from_file_location("bench_cuda_vs_official", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_worker_on_cpu(bench, tmp_path, capsys):
    from dclens.testing.make_tiny import make_tiny

    ckpt = str(tmp_path / "ckpt")
    _, cfg = make_tiny(ckpt, "dcpythia", n_layer=2, dim=32, n_head=4, vocab=64, window_size=8)
    cases = bench.make_cases([16], [1, 2])
    toks = {"B%d_T%d" % (B, T): bench.tokens(64, B, T) for T, B in cases}
    toks["B1_T12"] = bench.tokens(64, 1, 12)
    np.savez(tmp_path / "tokens.npz", **toks)
    job = dict(
        ckpt=ckpt,
        tmp=str(tmp_path),
        device="cpu",
        dtype="float32",
        cases=cases,
        repeat=1,
        grad_T=12,
        ref_T=16,
        ig_steps=4,
        deadline=time.time() + 120,
    )
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert bench.worker(str(tmp_path / "job.json")) == 0
    res = bench.parse_results(capsys.readouterr().out)
    assert not res["errors"], res
    assert res["dtype"] == "float32"
    assert [(r["T"], r["B"]) for r in res["cases"]] == [(16, 1), (16, 2)]
    assert all(r["tok_s"] > 0 and r["n"] >= 1 for r in res["cases"])
    assert res["grad"]["grad_s"] > 0 and math.isfinite(res["grad"]["ig_total"])
    # the float32 load of a float32 file is the same model
    assert res["f32"]["ig_total"] == pytest.approx(res["grad"]["ig_total"], rel=1e-6)
    logits = np.load(tmp_path / "dclens_logits.npy")
    grad = np.load(tmp_path / "dclens_grad.npy")
    assert logits.shape == (16, 64) and grad.shape == (12, 32)
    np.testing.assert_array_equal(np.load(tmp_path / "dclens_f32_logits.npy"), logits)


def test_worker_reports_a_failing_phase(bench, tmp_path, capsys):
    np.savez(tmp_path / "tokens.npz", B1_T4=np.zeros((1, 4), np.int64))
    job = dict(ckpt=str(tmp_path / "missing"), tmp=str(tmp_path), device="cpu", dtype="float32", cases=[])
    job.update(repeat=1, grad_T=4, ref_T=4, ig_steps=2, deadline=time.time() + 60)
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert bench.worker(str(tmp_path / "job.json")) == 0
    res = bench.parse_results(capsys.readouterr().out)
    assert set(res["errors"]) == {"native", "float32"}


def fake_run(bench, tmp_path):
    """A result as main() has it once both sides ran, with the arrays they leave."""
    rng = np.random.default_rng(0)
    ref, gref = rng.normal(size=(8, 16)), rng.normal(size=(4, 6))
    np.savez(tmp_path / "official.npz", ref_logits=ref, ref_grad=gref, logits=ref * 1.01, grad=gref * 0.99)
    np.save(tmp_path / "dclens_logits.npy", ref + 0.02 * np.abs(ref).max())
    np.save(tmp_path / "dclens_grad.npy", gref)
    np.save(tmp_path / "dclens_f32_logits.npy", ref)
    np.save(tmp_path / "dclens_f32_grad.npy", gref)
    setup = dict(layers=2, dim=6, heads=2, vocab=16, dtype="bfloat16", device="cuda", gpu="H200", torch="2.11")
    setup.update(
        transformers="5.17.0", kernels="new", ref_T=8, grad_T=4, checkpoint_bytes=2**30, build_s=1.0, save_s=2.0
    )
    case = dict(T=8, B=1, s=0.5, first_s=0.6, n=2, tok_s=16.0)
    return dict(
        setup=setup,
        official=dict(
            cases=[dict(case, peak_bytes=2**31, device_bytes=5 * 2**29), dict(T=8, B=2, skipped="budget")],
            grad=dict(T=4, steps=16, grad_s=0.1, ig_s=0.2, ig_total=1.5),
            ref_grad=dict(T=4, steps=16, ig_total=1.25),
        ),
        compiled=dict(cases=[dict(case, tok_s=32.0, first_s=40.0)]),
        dclens=dict(
            cases=[dict(case, tok_s=64.0, device_bytes=3 * 2**30)],
            grad=dict(grad_s=0.05, ig_s=0.4, ig_total=1.26),
            f32=dict(ig_total=1.25),
            errors={},
        ),
    )


def test_accuracy_and_report(bench, tmp_path, capsys):
    res = fake_run(bench, tmp_path)
    acc = res["accuracy"] = bench.accuracy(res, str(tmp_path))
    assert acc["reference"]["logits"] == 0
    assert acc["dclens float32 load"]["logits"] == 0 and acc["dclens float32 load"]["ig_total"] == 1.25
    assert acc["dclens bfloat16"]["logits"] == pytest.approx(0.02)
    assert acc["official bfloat16"]["logits"] == pytest.approx(0.01)
    assert acc["official bfloat16"]["grad"] == pytest.approx(0.01)
    assert acc["dclens vs official, both bfloat16"]["grad"] == pytest.approx(0.01 / 0.99)
    bench.report(res)
    out = capsys.readouterr().out
    assert "| 8 | 1 | 16 | 32 | 64 | 4.00x | 2.00x | 2.00 GiB | 2.50 GiB | 3.00 GiB |" in out
    assert "| 8 | 2 | budget | - | - | - | - | - | - | - |" in out
    assert "first call of each shape (compiles): T8 B1 40 s" in out
    assert "| dclens bfloat16 | 2.00e-02 | 0.00e+00 | 1.26 |" in out
    a = bench.parse_args(["--module", "M"])
    assert "0.00e+00" in bench.verdict(res, a) and res["ok"] is True
    res["accuracy"]["dclens float32 load"]["logits"] = 2e-3
    bench.verdict(res, a)
    assert res["ok"] is False
    del res["accuracy"]["dclens float32 load"]
    assert "not measured" in bench.verdict(res, a) and res["ok"] is None


def test_cases_and_budget(bench):
    assert bench.make_cases([512, 2048], [1, 8]) == [(512, 1), (2048, 1), (512, 8), (2048, 8)]
    done = [dict(T=512, B=1, s=1.0)]
    assert bench.fits([], 2048, 8, time.time(), 3)
    assert bench.fits(done, 512, 1, time.time() + 10, 3)
    assert not bench.fits(done, 2048, 8, time.time() + 100, 3)  # 52x the cost of the case done
    r = bench.timed(lambda: None, 2, time.time() + 60)
    assert r["n"] == 10  # cheap calls: up to 10 while they add up to under 0.5 s
    assert bench.timed(lambda: None, 2, time.time() - 1)["n"] == 0


def test_alarm_stops_a_long_call(bench):
    t0 = time.time()
    with pytest.raises(bench.OverBudget), bench.alarm_at(time.time() + 0.3):
        while time.time() - t0 < 10:
            time.sleep(0.01)
    assert time.time() - t0 < 5


def test_print_wheels(bench, capsys):
    assert bench.main(["--print-wheels"]) == 0
    assert capsys.readouterr().out.split() == bench.WHEELS
