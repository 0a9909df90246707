"""Training text for ``dclens train --data ...`` from this package's data.

dclens finds these through its ``dclens.train_data`` entry point group
(pyproject.toml; dclens.plugins) and never imports synth_tasks itself:

    --data synth[:N]    N generated lines per task (64), in a seeded order
    --data FILE.jsonl   the lines of a benchmark JSONL file

Each returns the sequences' texts with the answers' brackets removed, as
the benchmark reads them; a bad argument raises ValueError (dclens names
the --data value).
"""

from __future__ import annotations

import numpy as np

from .dataset import load_dataset, parse_texts
from .generate import generate


def synth(arg: str, seed: int) -> list[str]:
    """`arg` (the text after "synth:", or "") lines per task, generated with
    `seed` and shuffled with it."""
    try:
        n = int(arg) if arg else 64
    except ValueError:
        raise ValueError("synth:N needs a number of lines per task, not %r" % arg) from None
    if n < 1:
        raise ValueError("synth:N needs N >= 1 lines per task, not %d" % n)
    recs = generate(lines_per_task=n, seed=seed)
    order = np.random.default_rng(seed).permutation(len(recs))
    return [parse_texts(recs[i]["texts"])[0] for i in order]


def jsonl(path: str, seed: int) -> list[str]:
    """The texts of every line of a benchmark JSONL file, in file order."""
    return [ln.text for ln in load_dataset(path).lines]
