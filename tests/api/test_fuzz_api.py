"""A property-based fuzz of the public Python API (issue 22), with Hypothesis.

Every entry of tests/fuzz_table.py (functions and methods), TrainConfig's
checks and the CLI's argument parsing is called with some arguments
replaced by hostile values: wrong types, shapes, dtypes, signs and sizes.
Each call must return, or raise dclens.Error whose message names one of the
replaced arguments; any other exception, a crash or a hang (a SIGALRM
after CALL_TIMEOUT s) fails the test.

The budget is fixed: EXAMPLES examples per entry (DCLENS_FUZZ_EXAMPLES to
change), no deadline, a fixed seed (the same examples on every run, so CI
time is bounded and a failure reproduces), and the example database under
build/hypothesis (where failing examples are replayed first). The totals
(examples tried, refused, accepted) are printed at the end of the session
and written to build/fuzz-api-totals.json; docs/bad-inputs.md quotes them.
"""

import collections
import contextlib
import dataclasses
import io
import json
import os
import resource
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

import dclens

from conftest import FUZZ_LINE
from fuzz_table import ENTRIES, HOSTILE, Entry, L, N, T, V

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = int(os.environ.get("DCLENS_FUZZ_EXAMPLES", "25"))
CALL_TIMEOUT = 20
MEM_HEADROOM = 1 << 30
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    print_blob=True,
    database=DirectoryBasedExampleDatabase(os.path.join(ROOT, "build", "hypothesis")),
    suppress_health_check=list(HealthCheck),
)
TOTALS = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    path = os.path.join(ROOT, "build", "fuzz-api-totals.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"examples": EXAMPLES, **TOTALS}, f, indent=2)
    line = (
        "fuzz (Hypothesis): %d examples tried over %d callables (%d per callable): %d refused with "
        "dclens.Error, %d accepted"
        % (TOTALS["tried"], TOTALS["callables"], EXAMPLES, TOTALS["refused"], TOTALS["accepted"])
    )
    request.config.stash[FUZZ_LINE] = line  # printed by conftest's pytest_terminal_summary


@pytest.fixture(scope="module")
def ctx(tiny_factory, tmp_path_factory):
    d, _, _ = tiny_factory(model_type="dcpythia", n_layer=L, n_head=N, vocab=V, seed=41, window_size=4)
    d_sw, _, _ = tiny_factory(model_type="dcpythia", n_layer=L, n_head=N, vocab=V, seed=42, window_size=4, use_sw=True)
    model = dclens.load(d, n_threads=1)
    toks = np.array([3, 1, 4, 1, 5, 9][:T], np.int64)
    toks2 = np.array([3, 1, 7, 1, 5, 2][:T], np.int64)
    logits, cache = model.run_with_cache(toks)
    return dict(
        model=model,
        sw=dclens.load(d_sw, n_threads=1),
        dir=d,
        toks=toks,
        toks2=toks2,
        logits=logits,
        cache=cache,
        tmp=str(tmp_path_factory.mktemp("fuzz")),
    )


class _Hang(Exception):
    pass


def _vm_data():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _alarm(seconds, headroom=MEM_HEADROOM):
    """SIGALRM after `seconds` (a hang fails the test), and the process' data
    limited to what it has plus `headroom` bytes, so a call that tries to
    allocate without bound gets MemoryError / the engine's out-of-memory
    error instead of taking the machine's memory."""

    def on_alarm(signum, frame):
        raise _Hang("no answer after %d s" % seconds)

    old = signal.signal(signal.SIGALRM, on_alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    lim = _vm_data() + headroom
    resource.setrlimit(resource.RLIMIT_DATA, (lim if hard == resource.RLIM_INFINITY else min(lim, hard), hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        signal.signal(signal.SIGALRM, old)


def _words(entry: Entry, arg: str):
    singular = (arg[:-1],) if arg.endswith("s") else ()  # layers -> "layer 7 is out of range"
    return (arg, arg.replace("_", "-"), arg.replace("_", " ")) + singular + tuple(entry.names.get(arg, ()))


def _draw_args(data, entry: Entry):
    """(kwargs, names of the replaced arguments)."""
    kw, bad = {}, []
    for arg, valid in entry.args.items():
        if data.draw(st.booleans(), label="replace " + arg):
            kw[arg] = data.draw(HOSTILE, label=arg)
            bad.append(arg)
        else:
            kw[arg] = data.draw(valid, label=arg)
    return kw, bad


def _call(entry, fn, kw, bad):
    """Run fn(); a dclens.Error must name a replaced argument (when one was)."""
    TOTALS["tried"] += 1
    try:
        with _alarm(CALL_TIMEOUT), np.errstate(all="ignore"):
            fn()
    except dclens.Error as e:
        TOTALS["refused"] += 1
        msg = str(e).lower()
        if bad:
            words = [w.lower() for a in bad for w in _words(entry, a)]
            assert any(w in msg for w in words), "%s: the refusal names none of the replaced arguments %s: %s" % (
                entry.name,
                bad,
                e,
            )
        assert "\n" not in str(e).strip() or "Traceback" not in str(e)
        return
    except _Hang as e:
        pytest.fail("%s hung with %r: %s" % (entry.name, kw, e))
    except Exception as e:  # noqa: BLE001 -- the point of the test
        pytest.fail(
            "%s raised %s (not dclens.Error) with replaced %s = %r: %s"
            % (entry.name, type(e).__name__, bad, {a: kw[a] for a in bad}, e)
        )
    TOTALS["accepted"] += 1


def _run_entry(entry, data, ctx, kw_fix=None):
    kw, bad = _draw_args(data, entry)
    if kw_fix:
        kw = kw_fix(kw)
    _call(entry, lambda: entry.call(ctx, **kw), kw, bad)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_fuzz_api(entry, ctx):
    TOTALS["callables"] += 1

    def fix(kw):
        if entry.name == "load" and kw.get("path") is None and "path" not in entry.args:
            return kw
        if entry.name == "load" and kw["path"] is None:
            kw = dict(kw, path=ctx["dir"])
        if entry.name == "patching.run_patched" and kw["tokens"] is None:
            kw = dict(kw, tokens=ctx["toks2"])
        return kw

    @seed(22)
    @SETTINGS
    @given(data=st.data())
    def run(data):
        _run_entry(entry, data, ctx, fix)

    run()


# ------------------------------------------------------------------ train's configuration


def _train_entry():
    from dclens.train.loop import TrainConfig

    valid = dict(
        model_type=st.sampled_from(["dcpythia", "gpt_neox", "dcformer"]),
        n_layer=st.integers(1, 4),
        dim=st.sampled_from([16, 32, 64]),
        n_head=st.sampled_from([1, 2]),
        d_ff=st.integers(0, 64),
        vocab=st.integers(0, 300),
        window_size=st.one_of(st.none(), st.integers(1, 64)),
        window_type=st.sampled_from([None, "LG", "LGLL", "LGL6"]),
        rank=st.integers(1, 4),
        seq_len=st.integers(1, 64),
        batch_size=st.integers(1, 8),
        steps=st.integers(1, 100),
        lr=st.floats(1e-4, 1e-2),
        min_lr=st.just(0.0),
        warmup=st.integers(0, 10),
        weight_decay=st.floats(0, 0.5),
        grad_clip=st.floats(0, 2),
        beta1=st.floats(0, 0.99),
        beta2=st.floats(0, 0.999),
        eps=st.floats(1e-10, 1e-6),
        seed=st.integers(0, 2**32),
        data=st.sampled_from(["synth", "synth:2"]),
        lines=st.booleans(),
        bucket=st.booleans(),  # without lines: refused (check())
        tokenizer=st.sampled_from(["bytes", "bpe:300", "bpe:4096"]),
        ckpt_every=st.integers(1, 50),
        keep=st.integers(1, 3),
        log_every=st.integers(1, 10),
        n_threads=st.integers(0, 2),
        device=st.sampled_from(["cpu", "cuda"]),  # check() takes both; availability is train()'s
        progress=st.sampled_from([None, True, False]),
        mgate_dim=st.just(0),  # > 0 only with model_type dcformer (check()): its hostile values are fuzzed
    )

    def call(c, **kw):
        TrainConfig(out=os.path.join(c["tmp"], "run"), **kw).check()

    assert set(valid) == {f.name for f in dataclasses.fields(TrainConfig)} - {"out"}
    return Entry(
        "TrainConfig.check",
        call,
        valid,
        dict(n_head=("multiple", "head dim"), dim=("multiple", "head dim"), lr=("min_lr",), min_lr=("lr",)),
    )


TRAIN = _train_entry()


def test_fuzz_train_config(ctx):
    TOTALS["callables"] += 1

    @seed(22)
    @SETTINGS
    @given(data=st.data())
    def run(data):
        kw, bad = _draw_args(data, TRAIN)
        if not bad:
            return  # valid combinations may still refuse (dim % n_head): not this test's subject
        _call(TRAIN, lambda: TRAIN.call(ctx, **kw), kw, bad)

    run()


# ------------------------------------------------------------------ the CLI's argument parsing

_FLAG_VALUE = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "2",
            "all",
            "x",
            "",
            "1e9",
            "99999999999999999999",
            "pattern",
            "branches",
            "post",
            "cuda",
            "\udcff",
        ]
    ),
    st.text(max_size=4),
)


def _cli_argv(ctx):
    out = os.path.join(ctx["tmp"], "out.png")
    heat = st.lists(
        st.sampled_from(["--layer", "--head", "--hook", "--phase", "--grid-cols", "--cell-px", "--device"]),
        max_size=3,
        unique=True,
    ).flatmap(lambda flags: st.tuples(*[st.tuples(st.just(f), _FLAG_VALUE) for f in flags]))
    return st.one_of(
        heat.map(
            lambda pairs: (
                ["heatmap", "--model", ctx["dir"], "--text", "abc", "--out", out] + [x for p in pairs for x in p]
            )
        ),
        st.lists(_FLAG_VALUE, max_size=3).map(lambda rest: ["info", "--model"] + rest),
        st.lists(
            st.sampled_from(
                [
                    "--steps",
                    "--dim",
                    "--lr",
                    "--tokenizer",
                    "--window-type",
                    "--n-head",
                    "--seed",
                    "--stop-after",
                    "--lines",
                    "--data",
                ]
            ),
            max_size=3,
        )
        .flatmap(lambda flags: st.tuples(*[st.tuples(st.just(f), _FLAG_VALUE) for f in flags]))
        .map(lambda pairs: ["train", "--out", os.path.join(ctx["tmp"], "cli-run")] + [x for p in pairs for x in p]),
        st.lists(_FLAG_VALUE, max_size=3),
    )


def test_fuzz_cli_arguments(ctx, monkeypatch):
    """dclens <argv>: an exit status (argparse's usage error is status 2, a
    refusal 1 with 'dclens CMD: error: ...'), never a traceback. train is
    fuzzed up to its configuration check (nothing is trained)."""
    from dclens import cli
    from dclens.train import loop as train_mod

    TOTALS["callables"] += 1
    monkeypatch.setattr(train_mod, "train", lambda c, stop_after=None: c.check() or "checked")
    monkeypatch.setenv("COLUMNS", "200")

    @seed(22)
    @SETTINGS
    @given(argv=_cli_argv(ctx))
    def run(argv):
        TOTALS["tried"] += 1
        err = io.StringIO()
        try:
            with _alarm(CALL_TIMEOUT), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = cli.main(argv)
        except SystemExit as e:  # argparse: usage error (2) or --help (0)
            rc = e.code
        except _Hang:
            pytest.fail("dclens %r hung" % (argv,))
        except Exception as e:  # noqa: BLE001
            pytest.fail("dclens %r raised %s: %s" % (argv, type(e).__name__, e))
        assert rc in (0, 1, 2), (argv, rc)
        assert "Traceback" not in err.getvalue()
        TOTALS["accepted" if rc == 0 else "refused"] += 1

    run()
