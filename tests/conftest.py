"""Shared fixtures: generated tiny checkpoints and the numpy reference."""

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, HERE)  # tests/reference.py
# the tests never use the network: a Hub id is looked up in a cache on disk only
os.environ["HF_HUB_OFFLINE"] = "1"


FUZZ_LINE = pytest.StashKey()  # the API fuzz's totals (tests/test_fuzz_api.py)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = config.stash.get(FUZZ_LINE, None)
    if line:
        terminalreporter.write_line(line)


def shared_path(*parts):
    p = os.path.join(SHARED, *parts)
    if not os.path.exists(p):
        pytest.skip("shared data not found at %s" % p)
    return p


@pytest.fixture(scope="session")
def tb():
    """scripts/train_bundled.py as a module (the bundled twins' recipe)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_bundled", os.path.join(ROOT, "scripts", "train_bundled.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """make(**kwargs) -> (dir, state_dict, config), cached per kwargs."""
    from dclens.testing.make_tiny import make_tiny

    made = {}

    def make(**kw):
        key = repr(sorted(kw.items()))  # kwargs may hold dicts (moh=...)
        if key not in made:
            d = str(tmp_path_factory.mktemp("tiny"))
            sd, cfg = make_tiny(d, **kw)
            made[key] = (d, sd, cfg)
        return made[key]

    return make


def rel_err(a, b):
    """max |a - b| / max |b|."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-30)
    return float(np.abs(a - b).max() / scale)
