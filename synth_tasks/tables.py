"""The project's own vocabulary tables for the synthetic benchmark.

Everything the generator draws from lives here: people, objects with a
superclass ("a kind of ...") and/or a capability ("the thing that can ..."),
cities with their countries, adjectives with their opposites, and ordinal
scales (years, months, weekdays, hours, seasons).

The tables cover every word the published DCFormer data uses (so that
:func:`synth_tasks.generate.check_example` can also verify the published lines)
and add many more so that generated training data is diverse.  Two quirks of
the published data are kept on purpose, because models trained on generated data
are evaluated on the published file: German cities are "in German" (sic), and the
hour scale is written "N o'clock".

Object notation used below: ``"a dog"`` / ``"an apple"`` (singular, with its
article), ``"juice"`` (mass noun: "Anthony has juice", "The juice is Anthony's"),
``"jeans+"`` (plural: "Lisa has jeans", "The jeans are Lisa's").
"""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------
# People
# --------------------------------------------------------------------------

PEOPLE = [
    # the 50 names of the published data
    "Anthony",
    "Barbara",
    "Betty",
    "Brian",
    "Carol",
    "Charles",
    "Christopher",
    "Daniel",
    "David",
    "Deborah",
    "Donald",
    "Donna",
    "Dorothy",
    "Edward",
    "Elizabeth",
    "George",
    "Helen",
    "James",
    "Jason",
    "Jeff",
    "Jennifer",
    "John",
    "Joseph",
    "Karen",
    "Kenneth",
    "Kevin",
    "Kimberly",
    "Laura",
    "Linda",
    "Lisa",
    "Margaret",
    "Maria",
    "Mark",
    "Mary",
    "Michael",
    "Michelle",
    "Nancy",
    "Patricia",
    "Paul",
    "Richard",
    "Robert",
    "Ronald",
    "Ruth",
    "Sandra",
    "Sarah",
    "Sharon",
    "Steven",
    "Susan",
    "Thomas",
    "William",
    # more
    "Alice",
    "Amanda",
    "Amy",
    "Andrew",
    "Angela",
    "Anna",
    "Brenda",
    "Catherine",
    "Emily",
    "Emma",
    "Eric",
    "Frank",
    "Gary",
    "Gregory",
    "Jack",
    "Jacob",
    "Janet",
    "Jessica",
    "Joshua",
    "Justin",
    "Larry",
    "Matthew",
    "Nicole",
    "Olivia",
    "Peter",
    "Rachel",
    "Rebecca",
    "Samuel",
    "Scott",
    "Stephanie",
    "Timothy",
    "Victoria",
]

# --------------------------------------------------------------------------
# Objects
# --------------------------------------------------------------------------

# superclass -> objects ("Ruth has a sweater" ... "a kind of clothing")
SUPERCLASSES = {
    "animal": "a dog, a cat, a cow, a deer, a donkey, a duck, an elephant, a fox, "
    "a goat, a goose, a gorilla, a horse, a lion, a monkey, a mouse, a pig, "
    "a rabbit, sheep+, a squirrel, a tiger, a wolf, a bear, a zebra, "
    "a giraffe, a kangaroo, a camel, a hamster, a leopard",
    "insect": "a bee, a beetle, a mosquito, an ant, a butterfly, a grasshopper, "
    "a ladybug, a cockroach, a wasp, a dragonfly, a moth, a flea",
    "fruit": "an apple, an apricot, a banana, blackberries+, blueberries+, cherries+, "
    "a durian, grapes+, a kiwi, a lemon, a lime, a mango, an orange, "
    "a papaya, a peach, a pear, a pineapple, a plum, strawberries+, "
    "a watermelon, raspberries+, a coconut, a fig, a melon, an avocado",
    "food": "bread, a burger, cake, a hamburger, meat, pizza, spaghetti, a steak, "
    "a sandwich, soup, rice, noodles+, cheese, salad, pasta, a sausage",
    "drink": "beer, a cocktail, coffee, juice, soda, tea, vodka, whiskey, wine, "
    "milk, lemonade, champagne, cider, rum, brandy",
    "clothing": "a costume, a jacket, jeans+, a jersey, pants+, a shirt, shoes+, "
    "a sweater, trousers+, a T-shirt, underwear, a uniform, a coat, "
    "a dress, a hat, a scarf, a skirt, socks+, gloves+, boots+",
    "vehicle": "a bus, a car, a jeep, a motorcycle, a taxi, a truck, a van, a train, a tram, a tractor, a scooter",
    "weapon": "a cannon, a grenade, a gun, a handgun, a pistol, a revolver, a rifle, "
    "a shotgun, a sword, a dagger, a spear, a crossbow",
    "sport": "a baseball, a basketball, a football, a volleyball, a softball, a rugby ball, a tennis ball, a golf ball",
    "musical instrument": "a guitar, a piano, a violin, a drum, a flute, a trumpet, "
    "a cello, a harp, a saxophone, a clarinet, a banjo, "
    "a ukulele, an accordion, a harmonica, a trombone",
}

# capability -> objects ("Mark has swim fins" ... "the thing that can swim")
CAPABILITIES = {
    "drive": "a car, a jeep, a truck, a van, a tractor",
    "ride": "a bicycle, a horse, a motorcycle, a scooter, a skateboard, a camel",
    "write": "a biro, chalk, a pen, a pencil, a marker, a crayon",
    "paint": "a brush, a palette, a roller, spray, an easel",
    "clean": "a broom, a mop, a vacuum cleaner, a sponge, a duster",
    "cook": "an oven, a pan, a pot, a stove, a wok, a microwave, a grill",
    "kill": "a dagger, a gun, a knife, a sword, a rifle, a spear",
    "fly": "a glider, a helicopter, a plane, a jet, a drone, a balloon",
    "swim": "goggles+, swim fins+, a swimsuit, a snorkel, flippers+",
    "communicate": "a phone, a radio, a telegraph, a telephone, a walkie-talkie, a smartphone, a pager",
    "play": "a guitar, a piano, a violin, a drum, a flute",
    "calculate": "an abacus, a calculator, a computer, a slide rule",
}

# surface forms of the published data that differ from the tables above
# (used only to *read* published lines, never to generate)
OBJECT_ALIASES = {"pencils": "pencil"}


@dataclass(frozen=True)
class Obj:
    """An object: its bare name, how it is written after "has", and whether
    it takes "are" ("The jeans are Lisa's")."""

    name: str
    a_form: str
    plural: bool = False
    superclass: str | None = None
    capability: str | None = None

    @property
    def is_form(self) -> str:
        """ "The sweater is" / "The jeans are" """
        return f"The {self.name} {'are' if self.plural else 'is'}"


def _parse_objects(spec: str):
    for item in spec.split(","):
        item = item.strip()
        plural = item.endswith("+")
        item = item.rstrip("+")
        name = item.split(" ", 1)[1] if item.startswith(("a ", "an ")) else item
        yield name, item, plural


def _build_objects():
    objs: dict[str, dict] = {}
    for cls, spec in SUPERCLASSES.items():
        for name, a_form, plural in _parse_objects(spec):
            assert name not in objs, f"duplicate object {name!r} in SUPERCLASSES"
            objs[name] = dict(name=name, a_form=a_form, plural=plural, superclass=cls)
    for cap, spec in CAPABILITIES.items():
        for name, a_form, plural in _parse_objects(spec):
            if name in objs:
                assert objs[name].get("capability") is None, f"duplicate {name!r}"
                objs[name]["capability"] = cap
            else:
                objs[name] = dict(name=name, a_form=a_form, plural=plural, capability=cap)
    return {k: Obj(**v) for k, v in objs.items()}


OBJECTS: dict[str, Obj] = _build_objects()
# objects used by the "a kind of" tasks, and by the "the thing that can" tasks
CLASS_OBJECTS = [o for o in OBJECTS.values() if o.superclass]
TOOL_OBJECTS = [o for o in OBJECTS.values() if o.capability]

# --------------------------------------------------------------------------
# Cities
# --------------------------------------------------------------------------

COUNTRIES = {
    "the United States": [
        "New York",
        "Los Angeles",
        "Washington, D.C",
        "Chicago",
        "Boston",
        "San Francisco",
        "Seattle",
        "Houston",
        "Miami",
    ],
    "the United Kingdom": ["London", "Manchester", "Birmingham", "Liverpool", "Edinburgh", "Glasgow", "Oxford"],
    "France": ["Paris", "Lyon", "Marseille", "Nice", "Bordeaux", "Toulouse"],
    "German": ["Berlin", "Munich", "Hamburg", "Frankfurt", "Cologne", "Dresden"],  # sic
    "Italy": ["Rome", "Milan", "Venice", "Florence", "Naples", "Turin"],
    "Spain": ["Madrid", "Barcelona", "Valencia", "Seville", "Bilbao", "Malaga"],
    "Switzerland": ["Bern", "Zurich", "Geneva", "Basel", "Lausanne"],
    "Russia": ["Moscow", "Saint Petersburg", "Novosibirsk", "Kazan", "Sochi"],
    "China": ["Beijing", "Shanghai", "Guangzhou", "Shenzhen", "Chengdu", "Hangzhou"],
    "Japan": ["Tokyo", "Osaka", "Kyoto", "Sapporo", "Nagoya", "Yokohama"],
    "South Korea": ["Seoul", "Busan", "Incheon", "Daegu", "Gwangju"],
    "India": ["Mumbai", "New Delhi", "Bangalore", "Chennai", "Kolkata", "Hyderabad"],
    "Thailand": ["Bangkok", "Chiang Mai", "Pattaya", "Phuket"],
    "Brazil": ["Brasília", "Sao Paulo", "Rio de Janeiro", "Salvador", "Recife"],
    "Australia": ["Canberra", "Sydney", "Brisbane", "Melbourne", "Perth", "Adelaide"],
    "Canada": ["Ottawa", "Toronto", "Vancouver", "Montreal", "Calgary"],
    "Egypt": ["Cairo", "Alexandria", "Luxor"],
    "Mexico": ["Mexico City", "Cancun", "Guadalajara"],
    "Turkey": ["Istanbul", "Ankara", "Izmir"],
    "Greece": ["Athens", "Thessaloniki"],
    "the Netherlands": ["Amsterdam", "Rotterdam", "Utrecht"],
}


@dataclass(frozen=True)
class City:
    name: str
    country: str


CITIES: dict[str, City] = {c: City(c, country) for country, cs in COUNTRIES.items() for c in cs}

# --------------------------------------------------------------------------
# Adjectives
# --------------------------------------------------------------------------

# pairs of opposites; an adjective may have several opposites (happy: sad, unhappy)
OPPOSITE_PAIRS = [
    ("active", "passive"),
    ("good", "bad"),
    ("beautiful", "ugly"),
    ("interesting", "boring"),
    ("interesting", "uninteresting"),
    ("brave", "cowardly"),
    ("careful", "careless"),
    ("clean", "dirty"),
    ("comfortable", "uncomfortable"),
    ("correct", "incorrect"),
    ("safe", "dangerous"),
    ("honest", "dishonest"),
    ("loyal", "disloyal"),
    ("fast", "slow"),
    ("friendly", "unfriendly"),
    ("generous", "stingy"),
    ("happy", "sad"),
    ("happy", "unhappy"),
    ("healthy", "sick"),
    ("healthy", "unhealthy"),
    ("knowledgeable", "ignorant"),
    ("rational", "irrational"),
    ("responsible", "irresponsible"),
    ("lucky", "unlucky"),
    ("optimistic", "pessimistic"),
    ("rich", "poor"),
    ("popular", "unpopular"),
    ("reliable", "unreliable"),
    ("right", "wrong"),
    ("tall", "short"),
    ("strong", "weak"),
    ("successful", "unsuccessful"),
    # more
    ("young", "old"),
    ("quiet", "noisy"),
    ("polite", "rude"),
    ("kind", "cruel"),
    ("wise", "foolish"),
    ("patient", "impatient"),
    ("calm", "nervous"),
    ("hardworking", "lazy"),
    ("clever", "stupid"),
    ("humble", "arrogant"),
    ("modest", "arrogant"),
    ("mature", "immature"),
    ("cheerful", "gloomy"),
    ("famous", "unknown"),
    ("awake", "asleep"),
    ("thin", "fat"),
    ("hungry", "full"),
    ("early", "late"),
    ("tidy", "messy"),
    ("fair", "unfair"),
    ("sensible", "foolish"),
    ("wealthy", "poor"),
]


def _build_opposites():
    opp: dict[str, list[str]] = {}
    for a, b in OPPOSITE_PAIRS:
        opp.setdefault(a, []).append(b)
        opp.setdefault(b, []).append(a)
    return opp


OPPOSITES: dict[str, list[str]] = _build_opposites()
ADJECTIVES = sorted(OPPOSITES)

# --------------------------------------------------------------------------
# Ordinal scales
# --------------------------------------------------------------------------

# kind -> (the word used in "the <kind> just before", preposition, values in order)
ORDINAL_SCALES = {
    "year": ("in", [str(y) for y in range(1980, 2031)]),
    "month": (
        "in",
        [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ],
    ),
    "day": ("on", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]),
    "time": ("at", [f"{h} o'clock" for h in range(1, 13)]),
    "season": ("in", ["spring", "summer", "autumn", "winter"]),
}


@dataclass(frozen=True)
class Ordinal:
    """One value on an ordinal scale, e.g. Ordinal('month', 4) = May."""

    kind: str
    index: int

    @property
    def text(self) -> str:
        return ORDINAL_SCALES[self.kind][1][self.index]

    @property
    def prep(self) -> str:
        return ORDINAL_SCALES[self.kind][0]

    def shifted(self, step: int) -> Ordinal | None:
        j = self.index + step
        if 0 <= j < len(ORDINAL_SCALES[self.kind][1]):
            return Ordinal(self.kind, j)
        return None

    @property
    def next(self) -> Ordinal | None:
        return self.shifted(+1)

    @property
    def prev(self) -> Ordinal | None:
        return self.shifted(-1)


ORDINALS: dict[str, Ordinal] = {v: Ordinal(k, i) for k, (_, vs) in ORDINAL_SCALES.items() for i, v in enumerate(vs)}

# --------------------------------------------------------------------------
# Verbs (one is chosen per generated line, as in the published data)
# --------------------------------------------------------------------------

# (affirmative 3rd person, base form used after "does not" / "Who does not")
VERBS = {
    "possess": [("has", "have"), ("possesses", "possess"), ("owns", "own")],
    "visit": [
        ("wants to go to", "want to go to"),
        ("wants to visit", "want to visit"),
        ("longs for", "long for"),
        ("yearns for", "yearn for"),
    ],
    "arrive": [("arrived", "arrive"), ("appeared", "appear"), ("showed up", "show up")],
}


def lookup_object(text: str) -> Obj | None:
    """Find an object from any of its surface forms: 'sweater', 'a sweater',
    'The sweater is', 'The jeans are', 'pencils' (published quirk)."""
    t = text.strip()
    for suffix in (" is", " are"):
        if t.endswith(suffix):
            t = t[: -len(suffix)]
    for prefix in ("The ", "the ", "a ", "an "):
        if t.startswith(prefix):
            t = t[len(prefix) :]
    t = OBJECT_ALIASES.get(t, t)
    return OBJECTS.get(t)


def lookup_adjective(text: str) -> str | None:
    t = text.strip().lower()
    return t if t in OPPOSITES else None


def lookup_ordinal(text: str) -> Ordinal | None:
    t = text.strip()
    for prefix in ("in ", "at ", "on ", "In ", "At ", "On "):
        if t.startswith(prefix):
            t = t[len(prefix) :]
    return ORDINALS.get(t)
