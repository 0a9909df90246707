"""Generate new benchmark data in the published format from the project's tables.

    generate(task_ids=None, lines_per_task=12, seed=0) -> [{"task_id": ..., "texts": ...}]
    write_jsonl(path, lines)

Every line holds 8 examples of one task (the first 2 plain demonstrations,
examples 3-8 with the answer written ``[ X ]``), each on its own line, with a
leading newline: exactly the published layout.  Each example is rendered from
the task's template in :mod:`synth_tasks.tasks` and then read back and solved by
:func:`analyse` (the template's regex plus the tables), so every generated
answer is checked to be the unique correct one.  Generation is seeded per task
(``seed`` and the task id), so a task's lines do not depend on which other
tasks are generated.

Command line:  python -m synth_tasks.cli generate OUT.jsonl [--lines-per-task N]
               [--seed S] [--tasks task0,task5] [--exclude PUBLISHED.jsonl]
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import cache

from . import tables as T
from .tasks import TASKS, VERB_KINDS, Task, render, slots

N_EXAMPLES = 8
N_DEMOS = 2

# weights of the ordinal scales when an example draws its scale
ORDINAL_WEIGHTS = {"year": 4, "month": 3, "day": 2, "time": 3, "season": 1}

_POOLS = {
    "obj": T.CLASS_OBJECTS,
    "tool": T.TOOL_OBJECTS,
    "city": list(T.CITIES.values()),
    "adj": list(T.ADJECTIVES),
    "ordinal": list(T.ORDINALS.values()),
}

# ---------------------------------------------------------------------------
# item semantics
# ---------------------------------------------------------------------------


def ident(x) -> str:
    """The surface name of an item (what "copy" outputs)."""
    if isinstance(x, (T.Obj, T.City)):
        return x.name
    if isinstance(x, T.Ordinal):
        return x.text
    return str(x)


def transform_values(transform: str, x) -> list[str]:
    """The acceptable answers for source item x under an OV transformation."""
    if transform == "copy":
        return [ident(x)]
    if transform == "obj->superclass":
        return [x.superclass] if getattr(x, "superclass", None) else []
    if transform == "obj->capability":
        return [x.capability] if getattr(x, "capability", None) else []
    if transform == "city->country":
        return [x.country] if isinstance(x, T.City) else []
    if transform == "adj->opposite":
        return list(T.OPPOSITES.get(x, []))
    if transform in ("ordinal->next", "ordinal->prev"):
        if not isinstance(x, T.Ordinal):
            return []
        y = x.next if transform == "ordinal->next" else x.prev
        return [y.text] if y is not None else []
    raise ValueError(f"unknown transformation {transform!r}")


_TRANSFORM_POOL = {
    "copy": "obj",
    "obj->superclass": "obj",
    "obj->capability": "tool",
    "city->country": "city",
    "adj->opposite": "adj",
    "ordinal->next": "ordinal",
    "ordinal->prev": "ordinal",
}


def transform_pairs(transform: str) -> list[tuple[str, str]]:
    """(item, answer) for every item of the word tables the OV transformation applies to,
    e.g. ("lion", "animal") for obj->superclass: what a head implementing it must map."""
    if transform not in _TRANSFORM_POOL:
        raise ValueError(f"unknown transformation {transform!r}")
    out = []
    for x in _POOLS[_TRANSFORM_POOL[transform]]:
        for y in transform_values(transform, x)[:1]:
            out.append((ident(x), y))
    return out


def key_values(kind: str, x) -> list[str]:
    """What a query may name about item x for a QK pattern of this kind."""
    if kind in ("obj", "city", "adj", "ordinal"):
        return [ident(x)]
    if kind == "class":
        return [x.superclass] if getattr(x, "superclass", None) else []
    if kind == "capability":
        return [x.capability] if getattr(x, "capability", None) else []
    if kind == "country":
        return [x.country] if isinstance(x, T.City) else []
    if kind == "opposite":
        return list(T.OPPOSITES.get(x, []))
    if kind == "successor":
        return [x.next.text] if isinstance(x, T.Ordinal) and x.next is not None else []
    raise ValueError(f"unknown key kind {kind!r}")


def lookup_item(vocab: str, text: str):
    if vocab in ("obj", "tool"):
        return T.lookup_object(text)
    if vocab == "city":
        return T.CITIES.get(text)
    if vocab == "adj":
        return T.lookup_adjective(text)
    if vocab == "ordinal":
        return T.lookup_ordinal(text)
    raise ValueError(vocab)


def _pattern_parts(pattern: str) -> tuple[str, str]:
    """'the-other-person' -> ('the-other', 'person')"""
    for prefix in ("the-other", "same", "different"):
        if pattern.startswith(prefix + "-"):
            return prefix, pattern[len(prefix) + 1 :]
    raise ValueError(pattern)


# ---------------------------------------------------------------------------
# analysing (solving) one example
# ---------------------------------------------------------------------------


@dataclass
class Analysis:
    answer: str | None = None
    expected: set = field(default_factory=set)
    problems: list = field(default_factory=list)
    source: int | None = None  # which of the three context items (0..2) the answer comes from

    @property
    def ok(self) -> bool:
        return not self.problems


def analyse(task_id: str, example: str, strict: bool = False) -> Analysis:
    """Read one example of a task with its template, look its words up in the
    tables and solve it: the answer must be the task's transformation of the
    unique source item picked by the task's QK pattern.

    strict adds the generator's quality rules: distinct people where the task
    needs them, the answer not also derivable from another item, no adjective
    next to its opposite, one ordinal scale per example.
    """
    res = Analysis()
    t: Task = TASKS[task_id]
    m = t.match(example)
    if m is None:
        res.problems.append("does not match the template")
        return res
    g = m.groupdict()
    res.answer = g["A"]
    texts = [g[f"x{i}"] for i in (1, 2, 3)]
    items = [lookup_item(t.vocab, s) for s in texts]
    for s, x in zip(texts, items):
        if x is None:
            res.problems.append(f"unknown {t.vocab} {s!r}")
    if res.problems:
        return res
    persons = [g.get(f"p{i}") for i in (1, 2, 3)]
    prefix, kind = _pattern_parts(t.pattern)
    q = g.get("q")

    if prefix == "different":
        names = [ident(x) for x in items]
        odd = [i for i, n in enumerate(names) if names.count(n) == 1]
        if len(odd) != 1:
            res.problems.append(f"no single odd item among {names}")
            return res
        src = odd[0]
    else:
        if kind == "person":
            hit = [p == q for p in persons]
        else:
            if kind == "obj":
                qo = T.lookup_object(q)
                qv = qo.name if qo else q
            elif kind == "ordinal":
                qo = T.lookup_ordinal(q)
                qv = qo.text if qo else q
            else:
                qv = q
            hit = [qv in key_values(kind, x) for x in items]
        cand = [i for i, h in enumerate(hit) if (h if prefix == "same" else not h)]
        if len(cand) != 1 or not any(hit):
            res.problems.append(f"query {q!r} does not pick a single source ({hit})")
            return res
        src = cand[0]
    res.source = src

    answer_kind = [k for n, k, a in slots(t.template) if n == "A"][0]
    if answer_kind == "person":
        res.expected = {persons[src]}
    else:
        res.expected = set(transform_values(t.transform, items[src]))
    if "k" in g and g["k"] != getattr(items[src], "kind", None):
        res.problems.append(f"scale word {g['k']!r} but the source is a {items[src].kind}")
    if res.answer not in res.expected:
        res.problems.append(f"answer {res.answer!r}, expected {sorted(res.expected)}")

    if strict:
        others = [i for i in range(3) if i != src and ident(items[i]) != ident(items[src])]
        if answer_kind != "person":
            for i in others:
                if set(transform_values(t.transform, items[i])) & res.expected:
                    res.problems.append(f"answer also follows from {ident(items[i])!r}")
        if t.vocab == "adj":
            for a in items:
                for b in items:
                    if b in T.OPPOSITES.get(a, []):
                        res.problems.append(f"{a!r} and its opposite {b!r} together")
        if t.vocab == "ordinal" and len({x.kind for x in items}) != 1:
            res.problems.append("several ordinal scales in one example")
        if not t.context.startswith("list"):
            n_items = len({ident(x) for x in items})
            if n_items < (2 if prefix == "the-other" and kind != "person" else 3):
                res.problems.append("the same item twice")
        if persons[0] is not None:
            n_people = len(set(persons))
            want = 2 if t.pattern == "the-other-person" else 3
            if n_people != want:
                res.problems.append(f"{n_people} people, expected {want}")
        if prefix == "different" or (t.context.startswith("list") and prefix == "the-other"):
            names = [ident(x) for x in items]
            if len(set(names)) != 2:
                res.problems.append("a list needs one item twice and one other")
            if prefix == "the-other" and names.count(q) != 2:
                res.problems.append(f"{q!r} is not the repeated item")
    return res


# ---------------------------------------------------------------------------
# proposing examples
# ---------------------------------------------------------------------------


def _render_slot(kind: str, value) -> str:
    if kind == "obj_a":
        return value.a_form
    if kind == "obj_is":
        return value.is_form
    if kind == "Adj":
        return str(value).capitalize()
    if kind == "in_ord":
        return f"{value.prep} {value.text}"
    if kind == "In_ord":
        return f"{value.prep.capitalize()} {value.text}"
    return ident(value)


@cache
def _pools(task_id: str, scale: str | None):
    """(all items, items that can be the source, items the query can name)
    of a task, on one ordinal scale for the ordinal tasks."""
    t = TASKS[task_id]
    prefix, kind = _pattern_parts(t.pattern)
    pool = _POOLS[t.vocab]
    if t.vocab == "ordinal":
        pool = [o for o in pool if o.kind == scale]
    src = [x for x in pool if transform_values(t.transform, x)]
    keyed = []
    if kind != "person" and not t.context.startswith("list"):
        keyed = [x for x in pool if key_values(kind, x)]
        if prefix == "same":
            src = [x for x in src if key_values(kind, x)]
    return tuple(pool), tuple(src), tuple(keyed)


@cache
def _with_key(task_id: str, scale: str | None, kind: str, key: str):
    pool = _pools(task_id, scale)[0]
    return tuple(x for x in pool if key in key_values(kind, x))


def _propose(t: Task, rng: random.Random, verb: int, scale: str | None) -> dict:
    """Slot values (rendered strings) for one example: a random proposal that
    :func:`analyse` then accepts or rejects."""
    prefix, kind = _pattern_parts(t.pattern)
    pool, src_pool, keyed = _pools(t.task_id, scale)
    # items of the context; src: index of the source item
    if t.context.startswith("list"):
        a, b = rng.choice(pool), rng.choice(src_pool)
        items = [a, a]
        src = rng.randrange(3)
        items.insert(src, b)
        persons = [None] * 3
        q = a
    elif kind == "person":
        if prefix == "same":
            items = [rng.choice(src_pool) for _ in range(3)]
            persons = rng.sample(T.PEOPLE, 3)
            src = rng.randrange(3)
        else:
            P, Q = rng.sample(T.PEOPLE, 2)
            src = rng.randrange(3)
            persons = [Q if i == src else P for i in range(3)]
            items = [rng.choice(src_pool) for _ in range(3)]
        q = persons[src if prefix == "same" else (src + 1) % 3]
    else:
        persons = rng.sample(T.PEOPLE, 3)
        src = rng.randrange(3)
        if prefix == "same":
            s = rng.choice(src_pool)
            key = rng.choice(key_values(kind, s))
            items = [rng.choice(pool) for _ in range(3)]
            items[src] = s
        else:
            m = rng.choice(keyed)
            key = rng.choice(key_values(kind, m))
            if kind in ("class", "country", "capability"):
                same_key = [x for x in _with_key(t.task_id, scale, kind, key) if x != m]
                m2 = rng.choice(same_key) if same_key else m
            else:
                m2 = m
            pair = [m, m2]
            rng.shuffle(pair)
            items = pair
            items.insert(src, rng.choice(pool))
        q = key
    values = {}
    for i in range(3):
        values[f"x{i + 1}"] = items[i]
        values[f"p{i + 1}"] = persons[i]
    values["q"] = q
    if t.context.startswith("list") or kind == "person":
        values["A"] = rng.choice(transform_values(t.transform, items[src]))
    else:
        values["A"] = persons[src]
    values["k"] = getattr(items[src], "kind", None)
    out = {}
    for name, skind, _ in slots(t.template):
        if skind in VERB_KINDS:
            group, form = VERB_KINDS[skind]
            out[name] = T.VERBS[group][verb % len(T.VERBS[group])][form]
        else:
            out[name] = _render_slot(skind, values[name])
    return out


_BRACKETS = re.compile(r"\[ ?(.*?) ?\]")


def _unbracket(s: str) -> str:
    return _BRACKETS.sub(r"\1", s)


def generate_line(
    task_id: str,
    rng: random.Random,
    exclude=frozenset(),
    n_examples: int = N_EXAMPLES,
    n_demos: int = N_DEMOS,
    max_tries: int = 5000,
) -> dict:
    t = TASKS[task_id]
    verb = rng.randrange(12)  # one verb per line, as in the published data
    examples: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(examples) < n_examples:
        tries += 1
        if tries > max_tries:
            raise RuntimeError(f"{task_id}: could not generate an example")
        scale = None
        if t.vocab == "ordinal":
            kinds = list(ORDINAL_WEIGHTS)
            scale = rng.choices(kinds, weights=[ORDINAL_WEIGHTS[k] for k in kinds])[0]
        vals = _propose(t, rng, verb, scale)
        plain = render(t.template, vals, bracket=False)
        if plain in exclude or (plain in seen and tries < max_tries // 2):
            continue
        if not analyse(task_id, plain, strict=True).ok:
            continue
        seen.add(plain)
        examples.append(render(t.template, vals, bracket=len(examples) >= n_demos))
    return {"task_id": task_id, "texts": "\n" + "\n".join(examples) + "\n"}


def generate(task_ids=None, lines_per_task: int = 12, seed: int = 0, exclude=None) -> list[dict]:
    """New lines in the published format, ``lines_per_task`` for each task.

    task_ids: the tasks (default: all 74, in order).  exclude: examples (plain,
    with or without brackets) that must not be generated, e.g. every example
    of the published file to keep it held out (see :func:`examples_of`).
    """
    ids = list(TASKS) if task_ids is None else [task_ids] if isinstance(task_ids, str) else list(task_ids)
    for tid in ids:
        if tid not in TASKS:
            raise KeyError(f"unknown task {tid!r}")
    excl = frozenset(_unbracket(e) for e in (exclude or ()))
    out = []
    for tid in ids:
        rng = random.Random(f"synth_tasks:{seed}:{tid}")
        out.extend(generate_line(tid, rng, excl) for _ in range(lines_per_task))
    return out


def examples_of(records) -> set[str]:
    """The plain examples of records (dicts with 'texts'), for ``exclude``."""
    out = set()
    for r in records:
        for e in r["texts"].split("\n"):
            if e.strip():
                out.add(_unbracket(e))
    return out


def write_jsonl(path, lines) -> None:
    """Write records one per line, exactly as the published file does."""
    with open(path, "w", encoding="utf-8") as f:
        for r in lines:
            f.write(json.dumps({"task_id": r["task_id"], "texts": r["texts"]}) + "\n")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m synth_tasks.cli generate", description="Generate synthetic-benchmark data."
    )
    ap.add_argument("out", help="output JSONL file")
    ap.add_argument("--lines-per-task", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default=None, help="comma-separated task ids (default: all)")
    ap.add_argument("--exclude", default=None, help="a JSONL file whose examples must not be generated (hold-out)")
    a = ap.parse_args(argv)
    exclude = None
    if a.exclude:
        with open(a.exclude, encoding="utf-8") as f:
            exclude = examples_of(json.loads(l) for l in f if l.strip())
    ids = a.tasks.split(",") if a.tasks else None
    lines = generate(ids, a.lines_per_task, a.seed, exclude)
    write_jsonl(a.out, lines)
    print(f"wrote {len(lines)} lines to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
