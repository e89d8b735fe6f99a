"""A seeded fictional encyclopedia with multi-hop questions, for offline tests and demos.

Every name is made up from syllables, so no prior knowledge helps: the answers are only in the corpus. The
world holds people, cities, countries, companies, rivers and mountains linked to each other (birthplace,
founder, headquarters, capital, first ascent, ...). Passages follow the wiki-18 corpus of Search-R1/FlashRAG
(`{"id", "contents": "\"Title\"\ntext"}`, one or two per entity, plus distractor passages that share names
and near-duplicate facts with real ones). Questions follow the FlashRAG row format and come in four kinds
(`data_source`): `demo_1hop`, `demo_2hop` (bridge), `demo_compare` and `demo_multi` (several questions in
one prompt, answered as one `; `-separated answer).

Every row has the same keys, so that `datasets` loads a mixed file with one schema:
`id`, `question`, `golden_answers` (aliases), `data_source`, `supporting_ids` (one passage id per hop),
`hop_queries` (one search query per hop, aligned with `supporting_ids`: the single-hop question that the
passage answers, with the bridge entity's name for the second hop of a bridge question), `sub_questions`
and `sub_answers` (the individual questions and their alias lists of a `demo_multi` row, else empty).

Everything is drawn from one `random.Random(seed)`: the same seed gives byte-identical files.
"""

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import NamedTuple


KINDS = ("demo_1hop", "demo_2hop", "demo_compare", "demo_multi")
"""The `data_source` values of the generated rows."""

_KIND_SHARES = (0.3, 0.3, 0.2, 0.2)
_ENTITY_SHARES = {"person": 0.4, "city": 0.2, "company": 0.16, "river": 0.08, "mountain": 0.08}  # rest: countries
_ONSETS = ("b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ei", "ou")
_CODAS = ("", "", "", "", "l", "n", "r", "s", "th", "m", "k")
OCCUPATIONS = ("painter", "chemist", "architect", "novelist", "engineer", "composer", "cartographer", "astronomer")
_INDUSTRIES = {
    "Ironworks": "steel",
    "Shipping": "shipping",
    "Textiles": "textile",
    "Motors": "motor",
    "Press": "publishing",
    "Mills": "flour",
    "Glassworks": "glass",
    "Railways": "railway",
}
_BUILDINGS = ("Hall", "Library", "Theatre", "Bridge", "Tower", "Observatory")
_TWIN_SUFFIXES = ("sen", "ova", "ley", "ard")


@dataclass
class Entity:
    """One entity of the world: `kind` (person, city, country, company, river, mountain), `name` and `attrs`.

    Attributes that link to another entity hold that `Entity`; `aliases` are the accepted answers when the
    entity is the answer of a question (e.g. full name and surname).
    """

    kind: str
    name: str
    aliases: list[str]
    attrs: dict[str, object] = field(default_factory=dict)


@dataclass
class DemoWorld:
    """A generated world: its `entities`, the corpus `passages` and the QA rows in `questions`."""

    seed: int
    entities: list[Entity]
    passages: list[dict]
    questions: list[dict]


class DemoPaths(NamedTuple):
    """Paths of a demo data set: `corpus.jsonl`, `train.jsonl` and `test.jsonl`."""

    corpus: Path
    train: Path
    test: Path


@dataclass
class _Fact:
    """One answerable fact: its single-hop question, answer aliases and the key of the passage stating it."""

    question: str
    aliases: list[str]
    passage: str


# Single-hop question per (entity kind, attribute); `{s}` is the subject: a name, or a bridge phrase.
_QUESTIONS = {
    ("person", "birth_year"): "In which year was {s} born?",
    ("person", "birthplace"): "In which city was {s} born?",
    ("person", "occupation"): "What was the occupation of {s}?",
    ("person", "death_year"): "In which year did {s} die?",
    ("city", "country"): "In which country is {s}?",
    ("city", "population"): "What is the population of {s}?",
    ("city", "founded"): "In which year was {s} founded?",
    ("country", "capital"): "What is the capital of {s}?",
    ("company", "founder"): "Who founded {s}?",
    ("company", "founded"): "In which year was {s} founded?",
    ("company", "headquarters"): "In which city is {s} headquartered?",
    ("river", "length"): "How long is the {s}?",
    ("river", "source"): "Near which city is the source of the {s}?",
    ("mountain", "height"): "What is the height of {s}?",
    ("mountain", "first_ascent"): "Who first climbed {s}?",
    ("mountain", "country"): "In which country is {s}?",
}
# Bridge phrases naming the target of a link, for 2-hop questions.
_BRIDGES = {
    ("company", "founder"): "the founder of {s}",
    ("mountain", "first_ascent"): "the first person to climb {s}",
    ("person", "birthplace"): "the birthplace of {s}",
    ("company", "headquarters"): "the city where {s} is headquartered",
    ("country", "capital"): "the capital of {s}",
    ("river", "source"): "the city near the source of the {s}",
}
# Comparison questions per (kind, numeric attribute); `earlier` says whether the smaller value wins.
_COMPARISONS = {
    ("person", "birth_year"): ("Who was born earlier, {a} or {b}?", True),
    ("company", "founded"): ("Which company was founded earlier, {a} or {b}?", True),
    ("city", "population"): ("Which city has a larger population, {a} or {b}?", False),
    ("river", "length"): ("Which river is longer, the {a} or the {b}?", False),
    ("mountain", "height"): ("Which mountain is higher, {a} or {b}?", False),
}


def made_up_word(rng: random.Random, used: set[str], min_syllables: int = 2, max_syllables: int = 3) -> str:
    """A capitalised word of ``min_syllables``-``max_syllables`` syllables, at least 4 letters, not in ``used``
    (added to it): the words every name of a demo world is made of.

    Example:
        >>> used = {"Kisek"}
        >>> word = made_up_word(random.Random(0), used)
        >>> word[0].isupper() and word in used and len(used) == 2
        True
    """
    while True:
        count = rng.randint(min_syllables, max_syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(count))
        word = word.capitalize()
        if len(word) >= 4 and word not in used:
            used.add(word)
            return word


class _Namer:
    """Draws unique made-up words from syllables."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, min_syllables: int = 2, max_syllables: int = 3) -> str:
        return made_up_word(self.rng, self.used, min_syllables, max_syllables)


def article(noun: str) -> str:
    """``noun`` with its indefinite article.

    >>> article("engineer"), article("painter")
    ('an engineer', 'a painter')
    """
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _number_aliases(value: int, unit: str = "", short_unit: str = "") -> list[str]:
    """`12,400 metres`, `12400 metres`, `12400 m`, `12400`: the ways a number answer may be written."""
    grouped, plain = f"{value:,}", str(value)
    if not unit:
        return [grouped, plain] if grouped != plain else [plain]
    aliases = [f"{grouped} {unit}", f"{plain} {unit}", f"{plain} {short_unit}", plain]
    return list(dict.fromkeys(aliases))


class WorldBuilder:
    """Builds one demo world (`generate_world`; the lab's horizon world extends it); passages are keyed by strings
    until they are shuffled and numbered."""

    def __init__(self, seed: int, num_entities: int, distractor_rate: float):
        self.rng = random.Random(seed)
        self.namer = _Namer(self.rng)
        self.num_entities = num_entities
        self.distractor_rate = distractor_rate
        self.entities: list[Entity] = []
        self.passages: dict[str, tuple[str, str]] = {}  # key -> (title, text)
        self.facts: dict[tuple[int, str], _Fact] = {}  # (entity index, attribute) -> fact

    # ---- entities -------------------------------------------------------------------------------------

    def _add(self, kind: str, name: str, aliases: list[str] | None = None, **attrs) -> Entity:
        entity = Entity(kind, name, aliases or [name], dict(attrs))
        self.entities.append(entity)
        return entity

    def make_entities(self) -> None:
        rng, namer = self.rng, self.namer
        counts = {kind: max(2, round(share * self.num_entities)) for kind, share in _ENTITY_SHARES.items()}
        num_countries = max(2, self.num_entities - sum(counts.values()))
        countries = [self._add("country", namer.word()) for _ in range(num_countries)]
        cities = []
        for i in range(counts["city"]):
            country = countries[i % num_countries]
            cities.append(
                self._add(
                    "city",
                    namer.word(),
                    country=country,
                    founded=rng.randint(900, 1750),
                    population=rng.randint(40, 9000) * 100,
                )
            )
        for country, capital in zip(countries, cities):
            country.attrs["capital"] = capital
        # First names come from a small pool so that several people share one (a realistic distractor).
        first_names = [namer.word(2, 2) for _ in range(max(3, counts["person"] // 3))]
        people = []
        for _ in range(counts["person"]):
            first, surname = rng.choice(first_names), namer.word()
            birth = rng.randint(1750, 1930)
            people.append(
                self._add(
                    "person",
                    f"{first} {surname}",
                    [f"{first} {surname}", surname],
                    surname=surname,
                    birth_year=birth,
                    birthplace=rng.choice(cities),
                    occupation=rng.choice(OCCUPATIONS),
                    move_year=birth + rng.randint(20, 40),
                    residence=rng.choice(cities),
                    death_year=birth + rng.randint(45, 95),
                )
            )
        for _ in range(counts["company"]):
            founder = rng.choice(people)
            suffix = rng.choice(sorted(_INDUSTRIES))
            self._add(
                "company",
                f"{namer.word()} {suffix}",
                suffix=suffix,
                founder=founder,
                founded=founder.attrs["birth_year"] + rng.randint(22, 50),
                headquarters=rng.choice(cities),
                employees=rng.randint(2, 900) * 10,
            )
        for _ in range(counts["river"]):
            word = namer.word()
            self._add(
                "river",
                f"{word} River",
                [f"{word} River", word],
                country=rng.choice(countries),
                source=rng.choice(cities),
                length=rng.randint(40, 2400),
            )
        for _ in range(counts["mountain"]):
            climber, word = rng.choice(people), namer.word()
            self._add(
                "mountain",
                f"Mount {word}",
                [f"Mount {word}", word],
                country=rng.choice(countries),
                height=rng.randint(800, 7900),
                first_ascent=climber,
                ascent_year=climber.attrs["birth_year"] + rng.randint(20, 40),
            )

    # ---- passages -------------------------------------------------------------------------------------

    def _passage(self, key: str, title: str, text: str) -> str:
        self.passages[key] = (title, text)
        return key

    def _fact(self, index: int, attr: str, aliases: list[str], passage: str) -> None:
        entity = self.entities[index]
        question = _QUESTIONS[(entity.kind, attr)].format(s=entity.name)
        self.facts[(index, attr)] = _Fact(question, aliases, passage)

    def write_passages(self) -> None:
        for i, e in enumerate(self.entities):
            a, n = e.attrs, e.name
            if e.kind == "person":
                born = self._passage(
                    f"e{i}a",
                    n,
                    f"{n} was {article(a['occupation'])} born in {a['birth_year']} in {a['birthplace'].name}.",
                )
                later = self._passage(
                    f"e{i}b",
                    n,
                    f"In {a['move_year']}, {n} moved to {a['residence'].name}, where {a['surname']} "
                    f"died in {a['death_year']}.",
                )
                self._fact(i, "birth_year", [str(a["birth_year"])], born)
                self._fact(i, "birthplace", a["birthplace"].aliases, born)
                self._fact(i, "occupation", [a["occupation"]], born)
                self._fact(i, "death_year", [str(a["death_year"])], later)
            elif e.kind == "city":
                key = self._passage(
                    f"e{i}",
                    n,
                    f"{n} is a city in the country of {a['country'].name}. It was founded in {a['founded']} and "
                    f"has a population of {a['population']:,}.",
                )
                self._fact(i, "country", a["country"].aliases, key)
                self._fact(i, "population", _number_aliases(a["population"]), key)
                self._fact(i, "founded", [str(a["founded"])], key)
            elif e.kind == "country":
                key = self._passage(
                    f"e{i}", n, f"{n} is a country whose capital and largest city is {a['capital'].name}."
                )
                self._fact(i, "capital", a["capital"].aliases, key)
            elif e.kind == "company":
                industry = _INDUSTRIES[a["suffix"]]
                founding = self._passage(
                    f"e{i}a", n, f"{n} is a {industry} company founded in {a['founded']} by {a['founder'].name}."
                )
                seat = self._passage(
                    f"e{i}b",
                    n,
                    f"{n} is headquartered in {a['headquarters'].name} and employs {a['employees']:,} people.",
                )
                self._fact(i, "founder", a["founder"].aliases, founding)
                self._fact(i, "founded", [str(a["founded"])], founding)
                self._fact(i, "headquarters", a["headquarters"].aliases, seat)
            elif e.kind == "river":
                key = self._passage(
                    f"e{i}",
                    n,
                    f"The {n} is a river in {a['country'].name}, {a['length']:,} kilometres long. The source of "
                    f"the {n} is near {a['source'].name}.",
                )
                self._fact(i, "length", _number_aliases(a["length"], "kilometres", "km"), key)
                self._fact(i, "source", a["source"].aliases, key)
            else:
                key = self._passage(
                    f"e{i}",
                    n,
                    f"{n} is a mountain in the country of {a['country'].name} with a height of {a['height']:,} "
                    f"metres. It was first climbed in {a['ascent_year']} by {a['first_ascent'].name}.",
                )
                self._fact(i, "height", _number_aliases(a["height"], "metres", "m"), key)
                self._fact(i, "first_ascent", a["first_ascent"].aliases, key)
                self._fact(i, "country", a["country"].aliases, key)

    def write_distractors(self) -> None:
        """Passages that share names and near-duplicate facts with real ones but are about other things."""
        rng, namer = self.rng, self.namer
        people = [e for e in self.entities if e.kind == "person"]
        cities = [e for e in self.entities if e.kind == "city"]
        countries = [e for e in self.entities if e.kind == "country"]
        for i, e in enumerate(self.entities):
            if rng.random() >= self.distractor_rate:
                continue
            a, stem = e.attrs, e.aliases[-1].split()[0]  # surname, or the made-up word of the name
            if e.kind == "person" and rng.random() < 0.5:
                # A building named like the person, opened in the person's birth year, in another city.
                title = f"{a['surname']} {rng.choice(_BUILDINGS)}"
                text = f"{title} is a landmark in {rng.choice(cities).name}, opened in {a['birth_year']}."
            elif e.kind == "person":
                # A name-stem twin: same first name, a longer surname, another birth year and city.
                twin_surname = stem + rng.choice(_TWIN_SUFFIXES)
                if twin_surname in namer.used:
                    continue
                namer.used.add(twin_surname)
                title = twin = f"{e.name.split()[0]} {twin_surname}"
                born = a["birth_year"] + rng.randint(1, 30)
                text = f"{twin} was {article(rng.choice(OCCUPATIONS))} born in {born} in {rng.choice(cities).name}."
            elif e.kind == "company":
                other = rng.choice(sorted(set(_INDUSTRIES) - {a["suffix"]}))
                title = f"{stem} {other}"
                text = (
                    f"{title} is a {_INDUSTRIES[other]} company founded in {a['founded'] + rng.randint(3, 40)} by "
                    f"{rng.choice(people).name}."
                )
            elif e.kind == "city":
                title = f"Port {stem}"
                text = (
                    f"{title} is a harbour town in the country of {rng.choice(countries).name}. It was founded in "
                    f"{a['founded'] + rng.randint(50, 300)} and has a population of {rng.randint(5, 300) * 100:,}."
                )
            elif e.kind == "country":
                title = f"{stem} Highlands"
                text = f"The {title} are a plateau whose largest town is {rng.choice(cities).name}."
            elif e.kind == "river":
                title = f"Little {stem} River"
                text = (
                    f"The {title} is a stream, {rng.randint(5, 39)} kilometres long. The source of the {title} is "
                    f"near {rng.choice(cities).name}."
                )
            else:
                title = f"{stem} Pass"
                text = (
                    f"{title} is a mountain pass with a height of {rng.randint(400, a['height'] - 1):,} metres. It "
                    f"was first crossed by {rng.choice(people).name}."
                )
            self._passage(f"d{i}", title, text)

    # ---- questions ------------------------------------------------------------------------------------

    def _row(self, kind: str, question: str, aliases: list[str], facts: list[_Fact], queries: list[str]) -> dict:
        return {
            "question": question,
            "golden_answers": list(aliases),
            "data_source": kind,
            "supporting_ids": [f.passage for f in facts],
            "hop_queries": queries,
            "sub_questions": [],
            "sub_answers": [],
        }

    def one_hop(self) -> dict:
        fact = self.facts[self.rng.choice(sorted(self.facts))]
        return self._row("demo_1hop", fact.question, fact.aliases, [fact], [fact.question])

    def two_hop(self) -> dict:
        rng = self.rng
        index = {id(e): i for i, e in enumerate(self.entities)}
        links = [(i, attr) for (i, attr) in sorted(self.facts) if (self.entities[i].kind, attr) in _BRIDGES]
        i, attr = rng.choice(links)
        source, target = self.entities[i], self.entities[i].attrs[attr]
        # Skip target attributes that lead back to the source (the country of a country's capital).
        back = [k for k, v in target.attrs.items() if v is source]
        target_attrs = [k for (j, k) in sorted(self.facts) if j == index[id(target)] and k not in back]
        target_attr = rng.choice(target_attrs)
        first, second = self.facts[(i, attr)], self.facts[(index[id(target)], target_attr)]
        phrase = _BRIDGES[(source.kind, attr)].format(s=source.name)
        question = _QUESTIONS[(target.kind, target_attr)].format(s=phrase)
        return self._row("demo_2hop", question, second.aliases, [first, second], [first.question, second.question])

    def compare(self) -> dict:
        rng = self.rng
        kind, attr = rng.choice(sorted(_COMPARISONS))
        template, smaller_wins = _COMPARISONS[(kind, attr)]
        candidates = [i for i, e in enumerate(self.entities) if e.kind == kind]
        i, j = rng.sample(candidates, 2)
        a, b = self.entities[i], self.entities[j]
        if a.attrs[attr] == b.attrs[attr]:
            return {}
        winner = a if (a.attrs[attr] < b.attrs[attr]) == smaller_wins else b
        facts = [self.facts[(i, attr)], self.facts[(j, attr)]]
        question = template.format(a=a.name, b=b.name)
        return self._row("demo_compare", question, winner.aliases, facts, [f.question for f in facts])

    def multi(self) -> dict:
        rng = self.rng
        count = rng.choice((2, 2, 3))
        keys = rng.sample(sorted(self.facts), count)
        if len({i for i, _ in keys}) < count:
            return {}
        facts = [self.facts[k] for k in keys]
        question = "\n".join(f"{n}. {f.question}" for n, f in enumerate(facts, 1))
        row = self._row(
            "demo_multi", question, ["; ".join(f.aliases[0] for f in facts)], facts, [f.question for f in facts]
        )
        row["sub_questions"] = [f.question for f in facts]
        row["sub_answers"] = [list(f.aliases) for f in facts]
        return row

    def make_questions(self, num_questions: int) -> list[dict]:
        makers = (self.one_hop, self.two_hop, self.compare, self.multi)
        quotas = [round(share * num_questions) for share in _KIND_SHARES]
        quotas[0] += num_questions - sum(quotas)
        rows, seen = [], set()
        for maker, quota in zip(makers, quotas):
            made, attempts = 0, 0
            while made < quota and attempts < 50 * quota:
                attempts += 1
                row = maker()
                if row and row["question"] not in seen:
                    seen.add(row["question"])
                    rows.append(row)
                    made += 1
        self.rng.shuffle(rows)
        return rows

    def finish(self, rows: list[dict], seed: int) -> DemoWorld:
        """Shuffle the passages, number them like wiki-18 (`"0"`, `"1"`, ...) and point the rows at them."""
        keys = list(self.passages)
        self.rng.shuffle(keys)
        ids = {key: str(n) for n, key in enumerate(keys)}
        passages = [{"id": ids[k], "contents": f'"{self.passages[k][0]}"\n{self.passages[k][1]}'} for k in keys]
        questions = []
        for n, row in enumerate(rows):
            row["supporting_ids"] = [ids[k] for k in row["supporting_ids"]]
            questions.append({"id": f"demo_{n:04d}", **row})
        return DemoWorld(seed, self.entities, passages, questions)


def generate_world(
    seed: int = 0, num_entities: int = 140, num_questions: int = 250, distractor_rate: float = 0.5
) -> DemoWorld:
    """Generate a fictional world: entities, a corpus of passages and QA rows of the four `KINDS`.

    About 30% of the rows are 1-hop, 30% 2-hop, 20% comparison and 20% multi-objective; `num_questions` is a
    maximum (questions are unique, and a small world may run out of them). `distractor_rate` is the share of
    entities that get a distractor passage.

    Example:
        >>> world = generate_world(seed=0, num_entities=40, num_questions=20)
        >>> sorted({row["data_source"] for row in world.questions})
        ['demo_1hop', 'demo_2hop', 'demo_compare', 'demo_multi']
    """
    if num_entities < 30:
        raise ValueError(f"num_entities must be at least 30 (two entities of every kind), got {num_entities}")
    builder = WorldBuilder(seed, num_entities, distractor_rate)
    builder.make_entities()
    builder.write_passages()
    builder.write_distractors()
    rows = builder.make_questions(num_questions)
    return builder.finish(rows, seed)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` as JSON Lines (UTF-8, one object a line)."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_world(world: DemoWorld, out_dir: str | Path, test_fraction: float = 0.2) -> DemoPaths:
    """Write `corpus.jsonl`, `train.jsonl` and `test.jsonl` into `out_dir`; return their paths.

    The split is stratified: the last `test_fraction` of the rows of every kind go to the test set.

    Example:
        >>> import tempfile
        >>> paths = write_world(generate_world(seed=1), tempfile.mkdtemp())
        >>> [path.name for path in paths]
        ['corpus.jsonl', 'train.jsonl', 'test.jsonl']
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    test_ids = set()
    for kind in KINDS:
        rows = [row["id"] for row in world.questions if row["data_source"] == kind]
        test_ids.update(rows[len(rows) - round(len(rows) * test_fraction) :])
    paths = DemoPaths(out / "corpus.jsonl", out / "train.jsonl", out / "test.jsonl")
    write_jsonl(paths.corpus, world.passages)
    write_jsonl(paths.train, [row for row in world.questions if row["id"] not in test_ids])
    write_jsonl(paths.test, [row for row in world.questions if row["id"] in test_ids])
    return paths


def demo_paths() -> DemoPaths:
    """Paths of the small demo set shipped with the package (`generate_world()` with its defaults).

    Example:
        >>> demo_paths().train.name
        'train.jsonl'
    """
    root = Path(str(resources.files("mempo_trl.kit") / "demo"))
    return DemoPaths(root / "corpus.jsonl", root / "train.jsonl", root / "test.jsonl")
