"""The credit study's pre-registered confirmation (issue 56): each variant's numbers against `THRESHOLDS`.

Reads a credit study's summary (`lab/credit_study.py`, its ``credit_study.json`` or ``credit_study_ungated.json``)
and its outcome link's (`lab/outcome_link.py`, ``outcome_link.json``), made on fresh questions (another world seed,
K = 2 / 4 / 6; lab/preregistration_credit.md), and writes, per variant and K, every figure beside its threshold and
whether it meets it, the variants that confirm, and what the decision rule (`decision`) says the docs recommend.

    python lab/confirmation.py --credit runs/credit_seed3/credit_study.json \\
        --link runs/link_seed3/outcome_link.json --out lab/results/credit_confirmation.json
"""

import argparse
import json
import sys
from pathlib import Path


THRESHOLDS = {
    "auc": (">=", 0.90),
    "false_positive": ("<=", 0.10),
    "true_positive": (">=", 0.60),
    "spearman_share_em": (">=", 0.30),
    "spearman_share_em_low": (">", 0.0),
    "ordered_share_em": (">=", 0.20),
    "earlier_spearman_share_em": (">=", 0.20),
    "earlier_spearman_share_em_low": (">", 0.0),
}
"""The pre-registered thresholds, each met at every K by a variant that confirms, on the sampled memories: at the
answer round the AUC of the advantage ranking memories by facts kept and the false-positive share (the credit study's
targets), the true-positive share (complete memories with a positive advantage), the mean within-group Spearman
correlation of the advantage with the finished answer's share EM (its value and its 95% interval's low end) and the
share of groups ordered as their share EM; at every earlier round (after 1 to K - 1 searches) the same Spearman
correlation (value and low end)."""


def meets(value: float | None, rule: tuple[str, float]) -> bool:
    """Whether ``value`` meets ``rule`` (``(">=" | "<=" | ">", threshold)``); a missing value never does.

    >>> meets(0.9, (">=", 0.9)), meets(0.11, ("<=", 0.1)), meets(0.0, (">", 0.0)), meets(None, (">=", 0.0))
    (True, False, False, False)
    """
    if value is None:
        return False
    op, threshold = rule
    return value >= threshold if op == ">=" else value <= threshold if op == "<=" else value > threshold


def _value(cell: dict | None, name: str, part: str = "value") -> float | None:
    return ((cell or {}).get(name) or {}).get(part)


def variant_figures(credit: dict, link: dict, variant: str, k: str) -> dict:
    """The figures `THRESHOLDS` names, of ``variant`` at K = ``k``: the credit study's sampled groups and the outcome
    link's answer round (K searches) and earlier rounds (the lowest value and lowest low end over them)."""
    sampled = credit["figures"][k]["variants"][variant].get("sampled")
    rounds = link["figures"][k]
    answer = rounds[k]["variants"][variant]
    earlier = [rounds[r]["variants"][variant] for r in rounds if r != k]
    values = [_value(c, "spearman_share_em") for c in earlier]
    lows = [_value(c, "spearman_share_em", "low") for c in earlier]
    return {
        "auc": _value(sampled, "auc"),
        "false_positive": _value(sampled, "false_positive"),
        "true_positive": _value(answer, "true_positive"),
        "spearman_share_em": _value(answer, "spearman_share_em"),
        "spearman_share_em_low": _value(answer, "spearman_share_em", "low"),
        "ordered_share_em": _value(answer, "ordered_share_em"),
        "earlier_spearman_share_em": None if None in values or not values else min(values),
        "earlier_spearman_share_em_low": None if None in lows or not lows else min(lows),
    }


def decision(confirmed: list[str], default: str, spearman: dict[str, float]) -> str:
    """What the docs recommend (lab/preregistration_credit.md): the default when it confirms; else the confirmed
    variant with the highest worst-K answer-round Spearman (``spearman``) as an option for multi-part questions, the
    default unchanged until the RL comparison shows it winning; else that no variant is confirmed.

    >>> decision(["diff", "diff_filter"], "diff_filter", {})
    'keep the default diff_filter: it confirmed'
    >>> decision(["diff", "log_ratio"], "diff_filter", {"diff": 0.4, "log_ratio": 0.5})
    'recommend log_ratio as an option; the default diff_filter stays until rl_compare shows log_ratio winning'
    >>> decision([], "diff_filter", {})
    'no variant confirmed: withdraw the recommendation of any variant; the default diff_filter stays'
    """
    if default in confirmed:
        return f"keep the default {default}: it confirmed"
    if confirmed:
        best = max(confirmed, key=lambda v: spearman.get(v, float("-inf")))
        return f"recommend {best} as an option; the default {default} stays until rl_compare shows {best} winning"
    return f"no variant confirmed: withdraw the recommendation of any variant; the default {default} stays"


def confirmation(credit: dict, link: dict) -> dict:
    """Every variant's figures (`variant_figures`) beside `THRESHOLDS` at every K of both summaries, the variants
    that meet all of them at every K, and the `decision`."""
    ks = [k for k in credit["figures"] if k in link["figures"]]
    table, confirmed, worst = {}, [], {}
    for variant in credit["variants"]:
        cells = {}
        for k in ks:
            figures = variant_figures(credit, link, variant, k)
            cells[k] = {
                name: {"value": figures[name], "meets": meets(figures[name], rule)}
                for name, rule in THRESHOLDS.items()
            }
        table[variant] = cells
        if ks and all(cell["meets"] for by_k in cells.values() for cell in by_k.values()):
            confirmed.append(variant)
        values = [cells[k]["spearman_share_em"]["value"] for k in ks]
        worst[variant] = min(values) if values and None not in values else float("-inf")
    default = credit["default_variant"]
    return {
        "thresholds": {name: list(rule) for name, rule in THRESHOLDS.items()},
        "k": ks,
        "world": credit["study"]["world"],
        "variants": table,
        "confirmed": confirmed,
        "decision": decision(confirmed, default, worst),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--credit", required=True, help="the credit study's summary (credit_study.json)")
    parser.add_argument("--link", required=True, help="the outcome link's summary (outcome_link.json)")
    parser.add_argument("--out", required=True, help="where the confirmation's JSON goes")
    args = parser.parse_args(argv)
    try:
        credit, link = (json.loads(Path(p).read_text()) for p in (args.credit, args.link))
    except (OSError, json.JSONDecodeError) as err:
        print(f"error: cannot read a summary: {err}: pass the files the two runs wrote", file=sys.stderr)
        return 2
    if credit["study"]["world"] != link["study"]["world"]:
        print(f"error: {args.credit} and {args.link} are of different worlds: pass one run's pair", file=sys.stderr)
        return 2
    result = confirmation(credit, link)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"confirmed: {result['confirmed']}; {result['decision']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
