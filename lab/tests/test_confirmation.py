"""The pre-registered confirmation (`lab/confirmation.py`) by hand, and its fresh world at --quick size."""

import doctest
import json
import random

import confirmation
import credit_study


def test_doctests():
    assert doctest.testmod(confirmation).failed == 0


def _cell(value, low=None):
    return {"value": value, "low": value if low is None else low, "high": value}


def _summaries(good: dict, bad: dict):
    """A credit summary and an outcome link summary of K = 2 and 4, variants ``good`` (meets every threshold) and
    ``diff_filter`` (the default), the figures overridden by ``good`` / ``bad`` per name."""
    base = {"auc": 0.95, "false_positive": 0.05, "true_positive": 0.7, "spearman": 0.4, "low": 0.1, "ordered": 0.3}
    credit = {"default_variant": "diff_filter", "variants": {"good": {}, "diff_filter": {}}, "study": {"world": {}}}
    link = {"study": {"world": {}}, "figures": {}}
    credit["figures"] = {}
    for k in ("2", "4"):
        credit["figures"][k] = {"variants": {}}
        link["figures"][k] = {str(r): {"variants": {}} for r in range(1, int(k) + 1)}
        for name, over in (("good", good), ("diff_filter", bad)):
            f = {**base, **over}
            credit["figures"][k]["variants"][name] = {
                "sampled": {"auc": _cell(f["auc"]), "false_positive": _cell(f["false_positive"])}
            }
            for r in link["figures"][k]:
                link["figures"][k][r]["variants"][name] = {
                    "spearman_share_em": _cell(f["spearman"] if r == k else f.get("earlier", 0.25), f["low"]),
                    "ordered_share_em": _cell(f["ordered"]),
                    "true_positive": _cell(f["true_positive"]),
                }
    return credit, link


def test_a_variant_confirms_only_when_it_meets_every_threshold_at_every_k():
    credit, link = _summaries({}, {"auc": 0.72, "false_positive": 0.5})
    result = confirmation.confirmation(credit, link)
    assert result["confirmed"] == ["good"]
    assert result["variants"]["diff_filter"]["4"]["auc"] == {"value": 0.72, "meets": False}
    assert result["decision"].startswith("recommend good as an option; the default diff_filter stays")
    # an earlier round whose correlation is below 0.20 stops the variant, though the answer round is fine
    credit, link = _summaries({"earlier": 0.19}, {"auc": 0.72})
    assert confirmation.confirmation(credit, link)["confirmed"] == []
    # the true-positive share: rewarding almost nothing does not confirm
    credit, link = _summaries({"true_positive": 0.59}, {"auc": 0.72})
    result = confirmation.confirmation(credit, link)
    assert result["confirmed"] == [] and result["decision"].startswith("no variant confirmed")


def test_the_cli_refuses_summaries_of_two_worlds(tmp_path, capsys):
    credit, link = _summaries({}, {})
    link["study"]["world"] = {"seed": 9}
    (tmp_path / "c.json").write_text(json.dumps(credit))
    (tmp_path / "l.json").write_text(json.dumps(link))
    args = ["--credit", str(tmp_path / "c.json"), "--link", str(tmp_path / "l.json"), "--out", str(tmp_path / "o")]
    assert confirmation.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "different worlds" in line


def test_the_fresh_world_at_quick_size(tmp_path):
    """`--world_seed 3 --horizons 2 4 6 --quick`: another world, every K with its validation questions, a turn budget
    that the oracle's K = 6 episodes fit, and a warm start of its own (another digest)."""
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.warmstart import oracle_episode_turns
    from mempo_trl.retrieval import BM25Retriever

    study = credit_study.study_of(True, 3, [2, 4, 6])
    paths = credit_study.write_world(tmp_path, study)
    rows = credit_study.by_k(read_jsonl(paths["validation"]), study["world"]["horizons"], study["questions"])
    assert {k: len(r) for k, r in rows.items()} == {2: 2, 4: 2, 6: 2}
    default = credit_study.by_k(
        read_jsonl(credit_study.write_world(tmp_path / "d", credit_study.study_of(True))["validation"]), [2], 2
    )
    assert [r["question"] for r in rows[2]] != [r["question"] for r in default[2]]
    retriever = BM25Retriever.from_corpus(str(paths["corpus"]), cache_dir=str(tmp_path / "bm25"))
    protocol = credit_study.protocol_of(study)
    turns = oracle_episode_turns(rows[6][0], retriever, 3, protocol.max_turns, 0.3, random.Random(0), counted=True)
    assert len(turns) == 7
    assert credit_study.warm_digest(study) != credit_study.warm_digest(credit_study.study_of(True))
