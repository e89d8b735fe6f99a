"""The long-horizon task family of `lab/long_horizon.py`: rows that each ask K facts about K different entities of
the demo world (`mempo_trl.kit.demo_world`), in splits that share no question and no asked-about entity."""

from dataclasses import dataclass, field

from mempo_trl.kit.demo_world import WorldBuilder


HORIZON_ATTRIBUTES = {
    "person": ("birth_year", "occupation", "death_year"),
    "city": ("population", "founded"),
    "company": ("founded",),
    "river": ("length",),
    "mountain": ("height",),
}
"""The facts a long-horizon row asks: the attributes whose value is a number or a word, never another entity, so
that an entity-disjoint split stays disjoint in its answers too."""

HORIZON_SPLITS = ("warm", "rl", "validation", "test")
"""The splits of `generate_horizon_world`, disjoint in questions and in the entities they ask about."""

_HORIZON_POOL_SHARES = {"warm": 0.35, "rl": 0.35, "validation": 0.1, "test": 0.2}


@dataclass
class HorizonWorld:
    """A world for long-horizon questions: the corpus `passages`, the rows of every split (`HORIZON_SPLITS`), the
    names of the entities each split asks about (`pools`) and the made-up `words` every name is built from."""

    seed: int
    passages: list[dict]
    splits: dict[str, list[dict]]
    pools: dict[str, list[str]]
    words: list[str] = field(default_factory=list)


def _horizon_row(builder: WorldBuilder, keys: list[tuple[int, str]]) -> dict:
    """A K-objective row: K single-hop questions, each about another entity, answered as ``v1; v2; ...; vK``."""
    facts = [builder.facts[key] for key in keys]
    row = builder._row(
        f"horizon_{len(keys)}",
        "\n".join(f"{n}. {fact.question}" for n, fact in enumerate(facts, 1)),
        ["; ".join(fact.aliases[0] for fact in facts)],
        facts,
        [fact.question for fact in facts],
    )
    row["sub_questions"] = [fact.question for fact in facts]
    row["sub_answers"] = [list(fact.aliases) for fact in facts]
    return row


def generate_horizon_world(
    seed: int = 2,
    num_entities: int = 240,
    rows_per_horizon: dict[str, int] | None = None,
    horizons: tuple[int, ...] = (1, 2, 4, 6, 8),
    distractor_rate: float = 0.5,
) -> HorizonWorld:
    """Generate a world and long-horizon rows: each asks K facts (`HORIZON_ATTRIBUTES`) about K different entities,
    so an agent searches K times and answers with values it found up to K turns earlier (``data_source``
    ``horizon_K``; ``sub_answers`` give per-part EM/F1 credit, `mempo_trl.rewards.outcome_score`).

    The entities are dealt into four pools (35% warm, 35% rl, 10% validation, 20% test) and every row of a split
    asks only about entities of its pool: no split shares a question or an asked-about entity with another.
    ``rows_per_horizon``: rows per split and K (default warm 300, rl 120, validation 30, test 50); a small pool may
    run out of distinct rows, so counts are maxima. The corpus holds every entity (it is the world).

    Example:
        >>> world = generate_horizon_world(seed=0, num_entities=60, rows_per_horizon={"warm": 4, "rl": 2,
        ...                                "validation": 1, "test": 2}, horizons=(1, 4))
        >>> sorted({row["data_source"] for row in world.splits["test"]})
        ['horizon_1', 'horizon_4']
        >>> set(world.pools["test"]) & set(world.pools["warm"])
        set()
    """
    if num_entities < 30:
        raise ValueError(f"num_entities must be at least 30 (two entities of every kind), got {num_entities}")
    counts = {"warm": 300, "rl": 120, "validation": 30, "test": 50, **(rows_per_horizon or {})}
    builder = WorldBuilder(seed, num_entities, distractor_rate)
    builder.make_entities()
    builder.write_passages()
    builder.write_distractors()
    asked = [i for i, e in enumerate(builder.entities) if e.kind in HORIZON_ATTRIBUTES]
    builder.rng.shuffle(asked)
    pools, start = {}, 0
    for name in HORIZON_SPLITS:
        size = round(_HORIZON_POOL_SHARES[name] * len(asked)) if name != "test" else len(asked) - start
        pools[name] = asked[start : start + size]
        start += size
    rows: list[dict] = []
    split_of: dict[str, str] = {}
    for name in HORIZON_SPLITS:
        pool = pools[name]
        for k in horizons:
            if k > len(pool):
                raise ValueError(f"the {name} pool has {len(pool)} entities, too few for {k}-objective rows")
            made, attempts, seen = 0, 0, set()
            while made < counts[name] and attempts < 50 * counts[name]:
                attempts += 1
                chosen = builder.rng.sample(pool, k)
                keys = [(i, builder.rng.choice(HORIZON_ATTRIBUTES[builder.entities[i].kind])) for i in chosen]
                row = _horizon_row(builder, keys)
                if row["question"] not in seen:
                    seen.add(row["question"])
                    rows.append(row)
                    split_of[row["question"]] = name
                    made += 1
    world = builder.finish(rows, seed)
    splits: dict[str, list[dict]] = {name: [] for name in HORIZON_SPLITS}
    for row in world.questions:
        row["id"] = row["id"].replace("demo_", "horizon_")
        splits[split_of[row["question"]]].append(row)
    names = {name: sorted(builder.entities[i].name for i in pool) for name, pool in pools.items()}
    return HorizonWorld(seed, world.passages, splits, names, sorted(builder.namer.used))


if __name__ == "__main__":  # a module of the lab's scripts: running it would do nothing
    import sys

    sys.stderr.write(
        "error: lab/horizon_world.py is a module, not a script: long_horizon.py imports it (see lab/README.md).\n"
    )
    sys.exit(2)
