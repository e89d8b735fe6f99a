"""Does a higher memory advantage lead to a better finished answer? The credit study's outcome link (issue 56).

From the credit study's gated warm start (`lab/credit_study.py`, its run directory ``--study_out``, the same study
options), for the validation questions of each K: at every round from the first search's to the answer round, G
``<mem>`` blocks are sampled as the credit study samples them (`credit_study.sampled_groups` with ``back`` rounds
before the answer round; ``back`` 0 samples exactly the credit study's groups), scored as the trainer scores them,
and each episode is then finished greedily from its memory (`finish_episodes`: the turn goes on after the sampled
``</mem>``, searches are answered by the retriever, up to ``max_turns`` turns). The finished answer's all-parts EM
(every part right) and share EM (the share of parts right) are that memory's outcomes.

Per K, round and reward variant (`credit_study.VARIANTS`: the paper's default ``diff_filter``, unfiltered ``diff``,
``log_ratio``, the uncentred and ``losses`` ones, ...) the memory advantage of each memory (`group_advantages`) gives
(`link_figures`):
the mean within-group Spearman correlation of the advantage with each outcome (`spearman`; groups whose outcomes or
advantages are all equal have none), the share of groups the advantage orders as their outcomes (`ordered_as`), and
the true- and false-positive shares (`positive_shares`: memories that keep every fact found so far with a positive
advantage, and those short of one). At a round before the answer round, "complete" means every fact found so far
(the hops searched), since the later parts are in neither context. 95% bootstrap intervals over questions.

Each question's groups are appended to ``<out>/link_<digest>.jsonl`` as they are done, so a restart skips them.

    python lab/outcome_link.py                      # after `python lab/credit_study.py` -> lab/results/outcome_link.json
    python lab/outcome_link.py --world_seed 3 --horizons 2 4 6 --study_out runs/credit_seed3 --out runs/link_seed3
    python lab/outcome_link.py --quick --study_out DIR --out DIR2   # after `credit_study.py --quick --out DIR`
"""

import argparse
import json
import math
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import credit_study
from learning import _machine
from rl_smoke import checked_gate


RESULTS = Path("lab/results")


def ranks(values: list[float]) -> list[float]:
    """The rank of each value, 1 for the smallest, ties sharing their mean rank.

    >>> ranks([0.3, 0.1, 0.3, 0.2])
    [3.5, 1.0, 3.5, 2.0]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            out[i] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of ``xs`` and ``ys`` (Pearson's of their `ranks`); None when either is constant or
    there are fewer than 2 values.

    >>> spearman([1.0, 2.0, 3.0], [0.0, 0.5, 1.0]), spearman([1.0, 2.0, 3.0], [1.0, 0.0, 0.0])
    (1.0, -0.8660254037844387)
    >>> spearman([1.0, 2.0], [1.0, 1.0]) is None
    True
    """
    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def ordered_as(advantages: list[float], outcomes: list[float]) -> bool | None:
    """Whether the advantages order the memories as their outcomes do: every pair with different outcomes has the
    higher advantage on the better outcome (a tie in advantage is not ordered); None when the outcomes are all equal.

    >>> ordered_as([0.9, 0.1, 0.5], [1.0, 0.0, 1.0]), ordered_as([0.9, 0.5, 0.5], [1.0, 0.0, 0.5])
    (True, False)
    >>> ordered_as([0.9, 0.1], [1.0, 1.0]) is None
    True
    """
    pairs = [(i, j) for i in range(len(outcomes)) for j in range(len(outcomes)) if outcomes[i] > outcomes[j]]
    return all(advantages[i] > advantages[j] for i, j in pairs) if pairs else None


def positive_shares(advantages: list[float], complete: list[bool]) -> dict:
    """The counts behind the true- and false-positive shares of a group: complete memories (``tp`` of them with a
    positive advantage) and incomplete ones (``fp`` of them with a positive advantage).

    >>> positive_shares([0.5, -0.1, 0.2, -0.3], [True, True, False, False])
    {'tp': 1, 'complete': 2, 'fp': 1, 'incomplete': 2}
    """
    return {
        "tp": sum(a > 0 and c for a, c in zip(advantages, complete)),
        "complete": sum(complete),
        "fp": sum(a > 0 and not c for a, c in zip(advantages, complete)),
        "incomplete": sum(not c for c in complete),
    }


def found_so_far(held: list[bool], searched: int) -> bool:
    """Whether a memory keeps every fact of the first ``searched`` hops (the facts found so far).

    >>> found_so_far([True, False, False], 1), found_so_far([True, False, True], 3)
    (True, False)
    """
    return all(held[:searched])


def group_link(advantages: list[float], outcomes: dict[str, list[float]], held: list[list[bool]], searched: int):
    """One group's figures: `spearman` of the advantages with each outcome, `ordered_as` each outcome, and
    `positive_shares` over the memories complete so far (`found_so_far`).

    >>> group_link([1.0, -1.0], {"all_parts_em": [1.0, 0.0]}, [[True, True], [True, False]], 2)
    {'spearman_all_parts_em': 1.0, 'ordered_all_parts_em': True, 'tp': 1, 'complete': 1, 'fp': 0, 'incomplete': 1}
    """
    out: dict = {}
    for name, values in outcomes.items():
        out[f"spearman_{name}"] = spearman(advantages, values)
        out[f"ordered_{name}"] = ordered_as(advantages, values)
    complete = [found_so_far(h, searched) for h in held]
    return {**out, **positive_shares(advantages, complete)}


OUTCOMES = ("all_parts_em", "share_em")
"""The finished answer's outcomes: every part right (0 or 1), and the share of parts right."""


def link_figures(per_group: list[dict], resamples: int, seed: int) -> dict:
    """Over the groups of one K, round and variant (`group_link` each, one per question): per outcome the mean
    Spearman correlation (over the groups that have one) and the share of ordered groups (over the groups whose
    outcomes differ), each with the groups it counts; the true- and false-positive shares; each with a 95% bootstrap
    interval (questions resampled ``resamples`` times, fixed ``seed``). A figure with no group is None.

    >>> g = lambda s, o, tp, fp: {"spearman_share_em": s, "ordered_share_em": o, "tp": tp, "complete": 1,
    ...                           "fp": fp, "incomplete": 1}
    >>> f = link_figures([g(1.0, True, 1, 0), g(0.0, False, 0, 1), g(None, None, 1, 0)], 0, 0)
    >>> f["spearman_share_em"]["value"], f["spearman_share_em"]["groups"], f["ordered_share_em"]["value"]
    (0.5, 2, 0.5)
    >>> f["true_positive"]["value"], f["false_positive"]["value"]
    (0.6666666666666666, 0.3333333333333333)
    """
    stats = {}
    for name in OUTCOMES:
        if f"spearman_{name}" in (per_group[0] if per_group else {}):
            stats[f"spearman_{name}"] = lambda gs, n=name: _mean_of(gs, f"spearman_{n}")
            stats[f"ordered_{name}"] = lambda gs, n=name: _mean_of(gs, f"ordered_{n}")
    stats["true_positive"] = lambda gs: _share(gs, "tp", "complete")
    stats["false_positive"] = lambda gs: _share(gs, "fp", "incomplete")
    rng = random.Random(seed)
    samples = [[per_group[rng.randrange(len(per_group))] for _ in per_group] for _ in range(resamples)]
    out: dict = {"questions": len(per_group)}
    for name, stat in stats.items():
        value, groups = stat(per_group)
        boot = sorted(v for v, _ in (stat(s) for s in samples) if v is not None)
        out[name] = (
            None
            if value is None
            else {
                "value": value,
                "groups": groups,
                "low": boot[int(0.025 * (len(boot) - 1))] if boot else None,
                "high": boot[int(math.ceil(0.975 * (len(boot) - 1)))] if boot else None,
            }
        )
    return out


def _mean_of(groups: list[dict], key: str) -> tuple[float | None, int]:
    values = [float(g[key]) for g in groups if g.get(key) is not None]
    return (sum(values) / len(values) if values else None), len(values)


def _share(groups: list[dict], num: str, den: str) -> tuple[float | None, int]:
    total = sum(g[den] for g in groups)
    return (sum(g[num] for g in groups) / total if total else None), total


# ---------------------------------------------------------------------------------------------------- the phases


def finish_episodes(model, tokenizer, retriever, study: dict, starts: list[tuple]) -> list[dict]:
    """Each episode finished greedily from a sampled memory, batched: ``starts`` holds ``(row, base messages,
    history, the round's memory-mode messages, the ``<mem>`` block)``; the round's turn goes on after the block, a
    search is answered by ``retriever`` and the next round played, up to ``max_turns`` turns in all. Returns per
    episode the answer's outcomes (`OUTCOMES`; 0 when the episode ends without a well-formed answer), its searches
    after the memory and whether it ended format-valid."""
    from mempo_trl.context import render_information, render_prompt
    from mempo_trl.generation import HFGenerator
    from mempo_trl.rewards import part_scores
    from mempo_trl.rollout import cut_after_action
    from mempo_trl.turns import parse_turn

    protocol = credit_study.protocol_of(study)
    generator = HFGenerator(model, tokenizer, protocol.max_completion_length, temperature=0.0, batch_size=32)
    state = [
        {"row": row, "base": base, "history": list(history), "messages": messages, "prefix": block, "searches": 0}
        for row, base, history, messages, block in starts
    ]
    results: list[dict | None] = [None] * len(state)
    active = list(range(len(state)))
    while active:
        prompts = [
            render_prompt(tokenizer, state[i]["messages"])
            + tokenizer(state[i]["prefix"], add_special_tokens=False)["input_ids"]
            for i in active
        ]
        completions, _ = generator(prompts)
        still = []
        for i, ids in zip(active, completions):
            s = state[i]
            text = s["prefix"] + cut_after_action(ids, tokenizer, generator.eos_token_ids)[1]
            turn = parse_turn(text)
            turns = len(s["history"]) + 1
            if turn.valid and turn.action == "search" and turns < protocol.max_turns:
                passages = retriever.search([turn.content], protocol.retrieval_topk)[0]
                s["history"].append((text, render_information(passages)))
                s["messages"], s["prefix"] = protocol.round_messages(s["base"], s["history"]), ""
                s["searches"] += 1
                still.append(i)
                continue
            valid = turn.valid and turn.action == "answer"
            row = s["row"]
            ems = [em for em, _, _ in part_scores(turn.content if valid else None, [], row["sub_answers"], valid)]
            results[i] = {
                "all_parts_em": min(ems),
                "share_em": sum(ems) / len(ems),
                "searches": s["searches"],
                "format_valid": valid,
            }
        active = still
    return results


def link_groups(model, tokenizer, retriever, rows: list[dict], study: dict) -> list[dict]:
    """Per row, one group per round from the first search's to the answer round (``back`` K - 1 to 0: the credit
    study's `sampled_groups`), keyed by the searches done, each memory's episode finished (`finish_episodes`)."""
    groups: list[dict] = [{} for _ in rows]
    for back in range(max(len(r["hop_queries"]) for r in rows)):
        taking = [n for n, r in enumerate(rows) if len(r["hop_queries"]) > back]
        sampled = credit_study.sampled_groups(model, tokenizer, retriever, [rows[n] for n in taking], study, back)
        starts = []
        for n, group in zip(taking, sampled):
            row = rows[n]
            for draw, memory in zip(group["draws"], group["memories"]):
                rng = random.Random(f"{study['seed']}-{row['id']}-{draw}")
                base, history, messages = credit_study.round_before(row, retriever, study, rng, back)
                starts.append((row, base, history, messages, f"<mem> {memory} </mem>"))
        finished = iter(finish_episodes(model, tokenizer, retriever, study, starts))
        for n, group in zip(taking, sampled):
            ends = [next(finished) for _ in group["memories"]]
            group = {**group, "finished": ends}
            groups[n][str(len(rows[n]["hop_queries"]) - back)] = group
    return groups


def study_link(rows: dict[int, list[dict]], groups: dict, study: dict, tokenizer) -> dict:
    """Per K, searches done before the memory (K: the answer round) and variant: `link_figures` of `group_link`
    over the questions' groups of two or more memories; plus what the finished episodes were (memories, mean
    outcomes, format-valid share)."""
    results: dict = {}
    for k, k_rows in rows.items():
        parts = {r["id"]: credit_study.gold_token_parts(tokenizer, r) for r in k_rows}
        cell = results[str(k)] = {}
        for searched in range(1, k + 1):
            pool = [(r["id"], groups[r["id"]][str(searched)]) for r in k_rows if r["id"] in groups]
            pool = [(i, g) for i, g in pool if len(g["memories"]) >= 2]
            ends = [e for _, g in pool for e in g["finished"]]
            round_cell = cell[str(searched)] = {
                "memories": len(ends),
                "mean": {name: credit_study._mean([e[name] for e in ends]) for name in (*OUTCOMES, "format_valid")},
                "variants": {},
            }
            for variant in credit_study.VARIANTS:
                settings = credit_study.variant_settings(variant, study["quantile"])
                per_group = []
                for question, group in pool:
                    _, advantages = credit_study.group_advantages(group, settings, parts[question])
                    outcomes = {name: [e[name] for e in group["finished"]] for name in OUTCOMES}
                    per_group.append(group_link(advantages, outcomes, group["held"], searched))
                figures = link_figures(per_group, study["bootstrap"], study["seed"]) if per_group else None
                round_cell["variants"][variant] = figures
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    credit_study.add_study_arguments(parser)
    parser.add_argument("--study_out", default="runs/credit_study", help="the credit study's run directory")
    parser.add_argument("--out", default="runs/outcome_link", help="run directory (resumable; not in git)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    study = credit_study.study_from_args(args)
    out, study_out = Path(args.out), Path(args.study_out)
    published = credit_study.is_default_study(args) and args.study_out == "runs/credit_study"
    published = published and args.out == "runs/outcome_link"
    target = RESULTS if published else out
    from mempo_trl.outputs import OutputError, check_writable

    try:
        gate = checked_gate(study_out, study)
        for directory in {out, target}:
            check_writable(directory)
    except (ValueError, OutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "lab/outcome_link.py", *(argv if argv is not None else sys.argv[1:])])

    import torch

    from mempo_trl.data import read_jsonl
    from mempo_trl.retrieval import BM25Retriever

    torch.set_num_threads(1)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    start = time.perf_counter()
    digest = credit_study.warm_digest(study)
    world = study_out / "world"
    retriever = BM25Retriever.from_corpus(str(world / "corpus.jsonl"), cache_dir=str(study_out / "bm25"))
    rows = credit_study.by_k(read_jsonl(world / "validation.jsonl"), study["world"]["horizons"], study["questions"])
    model, tokenizer = credit_study.load_warm(study_out / "smollm2_base", study_out / f"warm_{digest}", args.device)
    out.mkdir(parents=True, exist_ok=True)
    order = credit_study.interleaved(rows)

    def score(chunk: list[dict]) -> list[dict]:
        return link_groups(model, tokenizer, retriever, chunk, study)

    groups = credit_study.scored_phase(out / f"link_{digest}.jsonl", order, score, log, "finished")
    figures = study_link(rows, groups, study, tokenizer)
    summary = {
        "command": command,
        "study": study,
        "warm_start": {"digest": digest, "gate": gate},
        "default_variant": credit_study.DEFAULT_VARIANT,
        "complete": len(groups) == len(order),
        "figures": figures,
        "seconds": time.perf_counter() - start,
        "machine": {**_machine(), "python": platform.python_version(), "torch": torch.__version__},
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / "outcome_link.json").write_text(json.dumps(summary, indent=1) + "\n")
    for k, cell in figures.items():
        answer = cell[k]["variants"]
        line = ", ".join(
            f"{v} {((answer[v] or {}).get('spearman_all_parts_em') or {}).get('value')}"
            for v in ("diff_filter", "diff", "diff_losses_uncentred")
        )
        log(f"K={k} answer round, Spearman(advantage, all-parts EM): {line}")
    log(f"wrote {target / 'outcome_link.json'} ({summary['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
