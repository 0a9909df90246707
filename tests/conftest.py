"""Shared fixtures: generated tiny checkpoints and the numpy reference."""

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
# what the tests cover, one folder each; `pytest -m passes` (or "not browser", ...)
# picks by folder (the markers are registered in pyproject.toml)
FOLDERS = ("passes", "api", "analyses", "features", "synth", "browser", "gpu")
# tests/reference.py, tolerances.py, ..., and the test modules of every folder
# by their (unique) basenames: tests/gpu/test_cuda_grad.py reuses the variant
# table of tests/passes/test_variants.py whichever folders are collected
sys.path[:0] = [HERE] + [os.path.join(HERE, f) for f in FOLDERS]
# the tests never use the network: a Hub id is looked up in a cache on disk only
os.environ["HF_HUB_OFFLINE"] = "1"


FUZZ_LINE = pytest.StashKey()  # the API fuzz's totals (tests/api/test_fuzz_api.py)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder under tests/ (passes, api, ...)."""
    for item in items:
        folder = os.path.relpath(str(item.path), HERE).split(os.sep)[0]
        if folder in FOLDERS:
            item.add_marker(folder)


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
