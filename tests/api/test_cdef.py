"""The cffi declarations (bindings/dclens/_cdef.py) agree with the public header."""

import os
import re
from pathlib import Path

from dclens._cdef import CDEF

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "engine", "include", "dclens.h")


def _norm(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"\s+", " ", text).replace("( ", "(").replace(" )", ")").strip()


def _prototypes(text):
    """name -> normalised prototype of every function declaration."""
    out = {}
    for m in re.finditer(r"[\w\s\*]+?\b(dcs_\w+)\s*\(([^;{]*?)\)\s*;", _norm(text)):
        out[m.group(1)] = _norm(m.group(0))
    return out


def test_every_cdef_function_matches_the_header():
    header = _prototypes(Path(HEADER).read_text())
    cdef = _prototypes(CDEF)
    assert cdef, "no prototypes parsed from the cdef"
    for name, proto in cdef.items():
        assert name in header, "%s is in _cdef.py but not in dclens.h" % name
        assert proto == header[name], "%s differs:\n cdef:   %s\n header: %s" % (name, proto, header[name])


def test_struct_fields_match():
    header = _norm(Path(HEADER).read_text())
    for struct in ("dcs_config", "dcs_load_options", "dcs_panel", "dcs_heatmap_spec", "dcs_hooks", "dcs_sae_config"):
        h = re.search(r"typedef struct \{([^}]*)\} %s;" % struct, header)
        c = re.search(r"typedef struct \{([^}]*)\} %s;" % struct, _norm(CDEF))
        assert h and c, struct
        fields = lambda body: re.findall(r"(\w+)\s*(?:,|;)", body)
        assert fields(c.group(1)) == fields(h.group(1)), struct
