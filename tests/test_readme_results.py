"""README numbers against the committed result files: every "mean +/- std" the README's "Does it learn?" section
quotes must be a (mean, std) pair that some committed summary holds, and the summaries behind its headline figures
must hold every arm and seed the README cites. Nothing here copies a README number: both sides are read."""

import json
import re
from pathlib import Path

from long_horizon import ARMS


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "lab" / "results"


def _section(title: str) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(f"## {title}")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end > 0 else None]


def _pairs(node, found: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Every (mean, std) pair of a summary, rounded as the README writes them: ``X_mean``/``X_std`` and
    ``memory_recall``/``memory_recall_std`` keys of one dict."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(value, int | float):
                continue
            stem = key.removesuffix("_mean")
            std = node.get(f"{stem}_std")
            if isinstance(std, int | float):
                found.add((f"{value:.3f}", f"{std:.3f}"))
        for value in node.values():
            _pairs(value, found)
    elif isinstance(node, list):
        for value in node:
            _pairs(value, found)
    return found


def _summaries() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]


def test_every_quoted_mean_and_std_is_in_a_committed_summary():
    known = set()
    for summary in _summaries():
        _pairs(summary, known)
    quoted = re.findall(r"(\d\.\d{3}) \+/- (\d\.\d{3})", _section("Does it learn?"))
    assert quoted, "the section quotes no mean +/- std"
    missing = [f"{m} +/- {s}" for m, s in quoted if (m, s) not in known]
    assert not missing, f"README numbers with no committed summary behind them: {missing}"


def test_the_headline_summaries_hold_every_arm_and_seed_the_readme_cites():
    section = _section("Does it learn?")
    headline = json.loads((RESULTS / "learning.json").read_text())
    cited = int(re.search(r"(\d+) seeds per arm(?! and K)", section).group(1))  # "... and K": the long-horizon one
    assert sorted(headline["arms"]) == ["full_history", "mempo", "outcome_only"]
    assert all(len(arm["seeds"]) >= cited for arm in headline["arms"].values())
    horizon = RESULTS / "long_horizon.json"
    if horizon.is_file() and "long_horizon" in section:
        summary = json.loads(horizon.read_text())
        match = re.search(r"(\d+) seeds? per arm and K", section)
        assert match, "the section does not say how many seeds per arm and K the long-horizon summary holds"
        for k, cells in summary["horizons"].items():
            assert sorted(cells) == sorted(ARMS), f"K={k}"
            short = {arm: cell["seeds"] for arm, cell in cells.items() if len(cell["seeds"]) < int(match.group(1))}
            assert not short, f"K={k}: fewer seeds than the README cites: {short}"
