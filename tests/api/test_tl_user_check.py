"""Issue 15's acceptance script (scripts/tl_user_check.py) passes."""

import os
import subprocess
import sys

from conftest import ROOT, shared_path


def test_tl_user_check_script():
    tok = shared_path("data", "gpt-neox-20b-tokenizer.json")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "tl_user_check.py"), "--tokenizer", tok],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout and "FAIL" not in r.stdout
