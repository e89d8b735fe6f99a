"""Every relative link in the README and the docs points at a file that exists and, with `#anchor`, at a heading
that is there (GitHub's anchor rule), so moving a section cannot leave the front door pointing nowhere."""

import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "lab").glob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_anchor_rule():
    page = ROOT / "lab" / "learning.md"
    assert "why-measured-the-memory-reward-has-nothing-to-say-where-the-memory-decides" in anchors(page)
    assert "the-shipped-warm-start-mem_drop--03" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT)})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_ci_runs_the_commands_of_the_quick_start_and_the_cpu_launches_only():
    """`.ci/readme_commands.py` reads the quick start and the laptop-launch bullet of "Training on GPUs", and stops at
    the next heading: a bullet that ran on into the rest of the README made CI run the Evaluation section's `eval`
    (into the quick start's output directory, refused) and would have run the tests and the lab's experiments."""
    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), str(ROOT / "README.md")],
        capture_output=True,
        text=True,
        check=True,
    )
    commands = done.stdout.splitlines()
    assert commands[0] == "mempo-trl kit learner --output_dir kit/learner"
    assert commands[-1].startswith(
        "mempo-trl train --config examples/configs/tiny_cpu.yaml --accelerate_config cpu_zero3"
    )
    assert not [c for c in commands if "pytest" in c or "lab/" in c or "outputs/eval_all" in c]
    outputs = [m.group(1) for c in commands if (m := re.search(r"--output_dir (\S+)", c))]
    assert len(outputs) == len(set(outputs))  # as a newcomer runs them in order, none overwrites another's results
