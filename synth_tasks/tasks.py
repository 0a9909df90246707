"""The 74 tasks of the synthetic benchmark: one readable table.

Each task pairs a QK pattern (which context item is the source) with an OV
transformation (what is done to that item to get the answer).  The labels were
derived by reading every line of the published data.

QK patterns (the query names a key; the source is the item that ...):
  same-X         ... matches the key (positive query: "Ruth has a kind of [..]",
                     "Who has a kind of sport? [..]")
  the-other-X    ... does NOT match the key: the negated forms "does not have",
                     "Who does not ...", "Which is not ...?"
  different-X    ... is the odd one out of a list ("Which is different?")
  with X what the query names about the source item:
    person, obj, city, adj, ordinal   the item itself (or its owner)
    class, country, capability        the item's superclass / country / capability
    opposite                          an opposite of the (adjective) item
    successor                         the value just after the (ordinal) item
                                      ("Who arrived the year just before 2012?")
OV transformations:
  copy, obj->superclass, obj->capability, city->country, adj->opposite,
  ordinal->next ("the year just before [2011]": 2010 -> 2011, the answer is the
  successor), ordinal->prev ("the year just after [2009]").
Tasks come in pairs with the same content and two surface forms: "Ruth has a
sweater." / "The sweater is Ruth's." (tasks 0-55), "Which is not sweater?" /
"Which is different?" (tasks 56-73).

A template describes one example (one line of a record's "texts"):
``{name:kind}`` is a slot, ``[{A:kind}]`` the answer (written ``[ X ]`` in the
scored examples 3-8 and plain ``X`` in the two demonstrations).  Slot kinds and
their regular expressions are in SLOT_KINDS; ``{v:has}`` / ``{v:have}`` etc. are
the verbs, constant within a line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

# ---------------------------------------------------------------------------
# Context forms (three facts, or a list of three items)
# ---------------------------------------------------------------------------

CONTEXTS = {
    "has": "< {p1:person} has {x1:obj_a}. {p2:person} has {x2:obj_a}. {p3:person} has {x3:obj_a}. >. ",
    "is-s": "< {x1:obj_is} {p1:person}'s. {x2:obj_is} {p2:person}'s. {x3:obj_is} {p3:person}'s. >. ",
    "likes": "< {p1:person} likes {x1:city}. {p2:person} likes {x2:city}. {p3:person} likes {x3:city}. >. ",
    "attracts": "< {x1:city} attracts {p1:person}. {x2:city} attracts {p2:person}. {x3:city} attracts {p3:person}. >. ",
    "is-adj": "< {p1:person} is {x1:adj}. {p2:person} is {x2:adj}. {p3:person} is {x3:adj}. >. ",
    "adj-p": "< {x1:Adj} {p1:person}. {x2:Adj} {p2:person}. {x3:Adj} {p3:person}. >. ",
    "arrived": "< {p1:person} arrived {x1:in_ord}. {p2:person} arrived {x2:in_ord}. {p3:person} arrived {x3:in_ord}. >. ",
    "in-arrived": "< {x1:In_ord} arrived {p1:person}. {x2:In_ord} arrived {p2:person}. {x3:In_ord} arrived {p3:person}. >. ",
    "list-obj": "There are {x1:obj_a}, {x2:obj_a}, {x3:obj_a}. ",
    "list-city": "There are {x1:city}, {x2:city}, {x3:city}. ",
    "list-adj": "There are {x1:adj}, {x2:adj}, {x3:adj}. ",
    "list-ord": "There are {x1:ordinal}, {x2:ordinal}, {x3:ordinal}. ",
}

# ---------------------------------------------------------------------------
# THE TABLE
#   id       QK pattern             OV transform       vocab     context       query (+ answer)
# vocab: which table the items come from (obj: objects with a superclass,
# tool: objects with a capability, city, adj, ordinal).
# ---------------------------------------------------------------------------

_TABLE = """
task0  | the-other-person     | obj->superclass | obj     | has        | {q:person} does not {v:have} a kind of [{A:class}]
task1  | the-other-person     | obj->superclass | obj     | is-s       | {q:person} does not {v:have} a kind of [{A:class}]
task2  | same-person          | obj->superclass | obj     | has        | {q:person} {v:has} a kind of [{A:class}]
task3  | same-person          | obj->superclass | obj     | is-s       | {q:person} {v:has} a kind of [{A:class}]
task4  | the-other-class      | copy            | obj     | has        | Who does not {v:have} a kind of {q:class}? [{A:person}]
task5  | the-other-class      | copy            | obj     | is-s       | Who does not {v:have} a kind of {q:class}? [{A:person}]
task6  | same-class           | copy            | obj     | has        | Who {v:has} a kind of {q:class}? [{A:person}]
task7  | same-class           | copy            | obj     | is-s       | Who {v:has} a kind of {q:class}? [{A:person}]
task8  | the-other-person     | copy            | obj     | has        | {q:person} does not {v:have} [{A:obj}]
task9  | the-other-person     | copy            | obj     | is-s       | {q:person} does not {v:have} [{A:obj}]
task10 | same-person          | copy            | obj     | has        | {q:person} {v:has} [{A:obj}]
task11 | same-person          | copy            | obj     | is-s       | {q:person} {v:has} [{A:obj}]
task12 | the-other-obj        | copy            | obj     | has        | Who does not {v:have} {q:obj}? [{A:person}]
task13 | the-other-obj        | copy            | obj     | is-s       | Who does not {v:have} {q:obj}? [{A:person}]
task14 | same-obj             | copy            | obj     | has        | Who {v:has} {q:obj}? [{A:person}]
task15 | same-obj             | copy            | obj     | is-s       | Who {v:has} {q:obj}? [{A:person}]
task16 | the-other-person     | city->country   | city    | likes      | {q:person} does not {v:visit} the city in [{A:country}]
task17 | the-other-person     | city->country   | city    | attracts   | {q:person} does not {v:visit} the city in [{A:country}]
task18 | same-person          | city->country   | city    | likes      | {q:person} {v:visits} the city in [{A:country}]
task19 | same-person          | city->country   | city    | attracts   | {q:person} {v:visits} the city in [{A:country}]
task20 | the-other-country    | copy            | city    | likes      | Who does not {v:visit} the city in {q:country}? [{A:person}]
task21 | the-other-country    | copy            | city    | attracts   | Who does not {v:visit} the city in {q:country}? [{A:person}]
task22 | same-country         | copy            | city    | likes      | Who {v:visits} the city in {q:country}? [{A:person}]
task23 | same-country         | copy            | city    | attracts   | Who {v:visits} the city in {q:country}? [{A:person}]
task24 | the-other-person     | copy            | city    | likes      | {q:person} does not {v:visit} [{A:city}]
task25 | the-other-person     | copy            | city    | attracts   | {q:person} does not {v:visit} [{A:city}]
task26 | same-person          | copy            | city    | likes      | {q:person} {v:visits} [{A:city}]
task27 | same-person          | copy            | city    | attracts   | {q:person} {v:visits} [{A:city}]
task28 | the-other-city       | copy            | city    | likes      | Who does not {v:visit} {q:city}? [{A:person}]
task29 | the-other-city       | copy            | city    | attracts   | Who does not {v:visit} {q:city}? [{A:person}]
task30 | same-city            | copy            | city    | likes      | Who {v:visits} {q:city}? [{A:person}]
task31 | same-city            | copy            | city    | attracts   | Who {v:visits} {q:city}? [{A:person}]
task32 | the-other-person     | obj->capability | tool    | has        | {q:person} does not {v:have} the thing that can [{A:capability}]
task33 | the-other-person     | obj->capability | tool    | is-s       | {q:person} does not {v:have} the thing that can [{A:capability}]
task34 | same-person          | obj->capability | tool    | has        | {q:person} {v:has} the thing that can [{A:capability}]
task35 | same-person          | obj->capability | tool    | is-s       | {q:person} {v:has} the thing that can [{A:capability}]
task36 | the-other-capability | copy            | tool    | has        | Who does not {v:have} the thing that can {q:capability}? [{A:person}]
task37 | the-other-capability | copy            | tool    | is-s       | Who does not {v:have} the thing that can {q:capability}? [{A:person}]
task38 | same-capability      | copy            | tool    | has        | Who {v:has} the thing that can {q:capability}? [{A:person}]
task39 | same-capability      | copy            | tool    | is-s       | Who {v:has} the thing that can {q:capability}? [{A:person}]
task40 | the-other-person     | adj->opposite   | adj     | is-adj     | {q:person} is not the opposite of [{A:adj}]
task41 | the-other-person     | adj->opposite   | adj     | adj-p      | {q:person} is not the opposite of [{A:adj}]
task42 | same-person          | adj->opposite   | adj     | is-adj     | {q:person} is the opposite of [{A:adj}]
task43 | same-person          | adj->opposite   | adj     | adj-p      | {q:person} is the opposite of [{A:adj}]
task44 | the-other-opposite   | copy            | adj     | is-adj     | Who is not the opposite of {q:adj}? [{A:person}]
task45 | the-other-opposite   | copy            | adj     | adj-p      | Who is not the opposite of {q:adj}? [{A:person}]
task46 | same-opposite        | copy            | adj     | is-adj     | Who is the opposite of {q:adj}? [{A:person}]
task47 | same-opposite        | copy            | adj     | adj-p      | Who is the opposite of {q:adj}? [{A:person}]
task48 | the-other-person     | ordinal->next   | ordinal | arrived    | {q:person} did not {v:arrive} the {k:kind} just before [{A:ordinal}]
task49 | the-other-person     | ordinal->next   | ordinal | in-arrived | {q:person} did not {v:arrive} the {k:kind} just before [{A:ordinal}]
task50 | same-person          | ordinal->next   | ordinal | arrived    | {q:person} {v:arrived} the {k:kind} just before [{A:ordinal}]
task51 | same-person          | ordinal->next   | ordinal | in-arrived | {q:person} {v:arrived} the {k:kind} just before [{A:ordinal}]
task52 | the-other-successor  | copy            | ordinal | arrived    | Who did not {v:arrive} the {k:kind} just before {q:ordinal}? [{A:person}]
task53 | the-other-successor  | copy            | ordinal | in-arrived | Who did not {v:arrive} the {k:kind} just before {q:ordinal}? [{A:person}]
task54 | same-successor       | copy            | ordinal | arrived    | Who {v:arrived} the {k:kind} just before {q:ordinal}? [{A:person}]
task55 | same-successor       | copy            | ordinal | in-arrived | Who {v:arrived} the {k:kind} just before {q:ordinal}? [{A:person}]
task56 | the-other-obj        | copy            | obj     | list-obj   | Which is not {q:obj}? The [{A:obj}]
task57 | different-obj        | copy            | obj     | list-obj   | Which is different? The [{A:obj}]
task58 | the-other-obj        | obj->superclass | obj     | list-obj   | Which is not {q:obj}? A kind of [{A:class}]
task59 | different-obj        | obj->superclass | obj     | list-obj   | Which is different? A kind of [{A:class}]
task60 | the-other-city       | copy            | city    | list-city  | Which is not {q:city}? [{A:city}]
task61 | different-city       | copy            | city    | list-city  | Which is different? [{A:city}]
task62 | the-other-city       | city->country   | city    | list-city  | Which is not {q:city}? The city in [{A:country}]
task63 | different-city       | city->country   | city    | list-city  | Which is different? The city in [{A:country}]
task64 | the-other-obj        | copy            | tool    | list-obj   | Which is not {q:obj}? The [{A:obj}]
task65 | different-obj        | copy            | tool    | list-obj   | Which is different? The [{A:obj}]
task66 | the-other-obj        | obj->capability | tool    | list-obj   | Which is not {q:obj}? The thing that can [{A:capability}]
task67 | different-obj        | obj->capability | tool    | list-obj   | Which is different? The thing that can [{A:capability}]
task68 | the-other-adj        | adj->opposite   | adj     | list-adj   | Which is not {q:adj}? The opposite of [{A:adj}]
task69 | different-adj        | adj->opposite   | adj     | list-adj   | Which is different? The opposite of [{A:adj}]
task70 | the-other-ordinal    | ordinal->next   | ordinal | list-ord   | Which is not {q:ordinal}? The {k:kind} just before [{A:ordinal}]
task71 | different-ordinal    | ordinal->next   | ordinal | list-ord   | Which is different? The {k:kind} just before [{A:ordinal}]
task72 | the-other-ordinal    | ordinal->prev   | ordinal | list-ord   | Which is not {q:ordinal}? The {k:kind} just after [{A:ordinal}]
task73 | different-ordinal    | ordinal->prev   | ordinal | list-ord   | Which is different? The {k:kind} just after [{A:ordinal}]
"""

# ---------------------------------------------------------------------------
# Slot kinds: regular expression used to recognise a slot
# ---------------------------------------------------------------------------

_OBJ = r"[A-Za-z][\w-]*(?: [a-z][\w-]*)?"  # sweater, vacuum cleaner, T-shirt
_CITY = r"[A-Z][\w'-]*(?: (?:de |da |do )?[A-Z][\w'-]*)*(?:, [A-Z]\.[A-Z]\.?)?"  # Washington, D.C
_ORD = r"(?:\d+(?: o'clock)?|[A-Za-z]+)"  # 2010, 8 o'clock, May, spring

SLOT_KINDS = {
    "person": r"[A-Z][a-z]+",
    "obj": _OBJ,
    "obj_a": r"(?:an? )?" + _OBJ,  # a sweater, jeans
    "obj_is": r"(?:The )?" + _OBJ + r" (?:is|are)",  # The sweater is, The jeans are
    "class": r"[a-z]+(?: [a-z]+)?",  # musical instrument
    "capability": r"[a-z]+",
    "city": _CITY,
    "country": r"(?:the )?[A-Z][\w'-]*(?: [A-Z][\w'-]*)*",  # the United Kingdom
    "adj": r"[a-z]+",
    "Adj": r"[A-Z][a-z]+",
    "ordinal": _ORD,
    "in_ord": r"(?:in|at|on) " + _ORD,
    "In_ord": r"(?:In|At|On) " + _ORD,
    "kind": r"[a-z]+",  # year, month, day, time, season
    # verbs
    "has": r"(?:has|possesses|owns)",
    "have": r"(?:have|possess|own)",
    "visits": r"(?:wants to go to|wants to visit|longs for|yearns for)",
    "visit": r"(?:want to go to|want to visit|long for|yearn for)",
    "arrived": r"(?:arrived|appeared|showed up)",
    "arrive": r"(?:arrive|appear|show up)",
}

VERB_KINDS = {
    "has": ("possess", 0),
    "have": ("possess", 1),
    "visits": ("visit", 0),
    "visit": ("visit", 1),
    "arrived": ("arrive", 0),
    "arrive": ("arrive", 1),
}

_SLOT_RE = re.compile(r"(\[)?\{(\w+):(\w+)\}(\])?")


@dataclass(frozen=True)
class Task:
    task_id: str
    pattern: str  # QK pattern, e.g. "the-other-person"
    transform: str  # OV transformation, e.g. "obj->superclass"
    vocab: str  # obj | tool | city | adj | ordinal
    context: str  # key of CONTEXTS
    query: str  # query template, with the answer slot [{A:kind}]

    @property
    def template(self) -> str:
        """The whole template of one example."""
        return CONTEXTS[self.context] + self.query

    @property
    def negated(self) -> bool:
        return self.pattern.startswith("the-other-")

    @property
    def index(self) -> int:
        return int(self.task_id[4:])

    @property
    def regex(self) -> re.Pattern:
        return compile_template(self.template)

    def match(self, example: str):
        """Match one example (brackets present or not); returns the re.Match or None."""
        return self.regex.fullmatch(example)


def _parse_table(text: str) -> dict[str, Task]:
    tasks = {}
    for row in text.strip().splitlines():
        cells = [c.strip() for c in row.split("|")]
        t = Task(*cells)
        assert t.task_id not in tasks
        assert t.context in CONTEXTS, t
        tasks[t.task_id] = t
    return tasks


TASKS: dict[str, Task] = _parse_table(_TABLE)
PATTERNS = sorted({t.pattern for t in TASKS.values()})
TRANSFORMS = sorted({t.transform for t in TASKS.values()})


@cache
def compile_template(template: str) -> re.Pattern:
    """Template -> regex with one named group per slot. The answer slot
    ``[{A:kind}]`` matches both ``[ X ]`` and a bare ``X``."""
    out, pos = [], 0
    for m in _SLOT_RE.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        open_, name, kind, close = m.groups()
        body = f"(?P<{name}>{SLOT_KINDS[kind]})"
        if open_ and close:
            out.append(rf"(?P<{name}_open>\[ )?{body}(?({name}_open) \])")
        else:
            out.append(body)
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def slots(template: str) -> list[tuple[str, str, bool]]:
    """[(name, kind, is_answer)] in template order."""
    return [(m.group(2), m.group(3), bool(m.group(1))) for m in _SLOT_RE.finditer(template)]


def render(template: str, values: dict[str, str], bracket: bool) -> str:
    """Fill a template with already rendered slot strings; the answer slot is
    written ``[ X ]`` when bracket is true."""

    def sub(m):
        open_, name, kind, close = m.groups()
        v = values[name]
        return f"[ {v} ]" if (open_ and bracket) else v

    return _SLOT_RE.sub(sub, template)


def line_matches(task_id: str, texts_or_text: str) -> bool:
    """Whether every example of a line (raw ``texts`` or bracket-free text)
    fits the template of its task; False for tasks not in the table."""
    t = TASKS.get(task_id)
    if t is None:
        return False
    examples = [e for e in texts_or_text.split("\n") if e.strip()]
    return bool(examples) and all(t.match(e) for e in examples)


def task_labels(task_id: str) -> tuple[str | None, str | None]:
    t = TASKS.get(task_id)
    return (t.pattern, t.transform) if t else (None, None)
