"""`mempo-trl view`: the rollout logs of a run, or the trajectories of an ``eval`` output, as one self-contained
HTML page (docs/viewer.md).

`load_episodes` reads a run directory (its ``rollouts/``), one rollout log file (`mempo_trl.rollout_log`) or an
``eval`` output (``trajectories.jsonl``, one or both context modes); `page_data` turns the episodes into the page's
data: each distinct passage stored once, each round with the passages that hold a gold answer marked and the rounds
its context shows (`shown_rounds`); `render_page` embeds it as JSON in the page template (``viewer_page.html``:
inline CSS and JS, no network), which filters, pages and draws the episodes in the browser.

What cannot be read is said, never a traceback: a path that is none of those, a run without logged steps or a log of
another version raise `ViewerError` (one ``error:`` line from the command); a line cut short (a copy of a file being
written) or a file with fewer episodes than its header says become notices at the top of the page.
"""

import json
import re
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from mempo_trl.context import shown_rounds
from mempo_trl.rewards import normalize_answer
from mempo_trl.rollout_log import ROLLOUT_LOG_FORMAT, ROLLOUT_LOG_VERSION, ROLLOUTS_DIR


TRAJECTORIES_FILE = "trajectories.jsonl"
"""What ``mempo-trl eval`` writes into its ``output_dir``: one line per question and context mode."""
STEP_FILES = re.compile(r"step-(\d+)\.jsonl")
"""The names of the step files of a ``rollouts/`` folder."""
_PASSAGE = re.compile(r"^Doc \d+\(Title:", re.MULTILINE)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class ViewerError(ValueError):
    """Input the viewer cannot show; the message names the path and what to do."""


@dataclass
class Loaded:
    """What `load_episodes` read: the episode records (each with ``step`` for a training log, ``context_mode``), the
    kind of source (``"training"`` or ``"eval"``) and the notices to show above them."""

    kind: str
    episodes: list[dict]
    notices: list[str] = field(default_factory=list)


def read_json_lines(path: Path, notices: list[str]) -> list[dict]:
    """The JSON objects of the lines of ``path``; a line that is not one is skipped with a notice (the last line
    cut short: the file was copied while being written)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    found = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            found.append(value)
        elif number == len(lines):
            notices.append(f"{path.name}: its last line (line {number}) is cut short and was skipped.")
        else:
            notices.append(f"{path.name}: line {number} is not a JSON object and was skipped.")
    return found


def read_step_log(path: Path, notices: list[str]) -> list[dict]:
    """The episode records of one rollout log file, each with the header's ``context_mode``; `ViewerError` for a
    file that is not a rollout log or is of another version."""
    lines = read_json_lines(path, notices)
    head = lines[0] if lines else {}
    if head.get("format") != ROLLOUT_LOG_FORMAT:
        raise ViewerError(
            f"{path}: not a mempo-trl rollout log (its first line is not a header with format "
            f"{ROLLOUT_LOG_FORMAT!r}); pass a run directory, a rollouts/step-NNNNNN.jsonl file or an eval output."
        )
    if head.get("version") != ROLLOUT_LOG_VERSION:
        raise ViewerError(
            f"{path}: rollout log version {head.get('version')!r}, but this mempo_trl reads version "
            f"{ROLLOUT_LOG_VERSION}: view it with the mempo_trl version that wrote it."
        )
    episodes = [{"context_mode": head.get("context_mode", "memory"), **line} for line in lines[1:]]
    if len(episodes) < head.get("episodes", 0):
        notices.append(f"{path.name}: {len(episodes)} of the {head['episodes']} episodes its header lists were read.")
    return episodes


def read_trajectories(path: Path, notices: list[str]) -> list[dict]:
    """The records of an ``eval`` output's ``trajectories.jsonl``; `ViewerError` when they are not eval records."""
    records = read_json_lines(path, notices)
    if records and records[0].get("format") == ROLLOUT_LOG_FORMAT:
        return read_step_log(path, notices)
    if not records or not all(isinstance(r.get("rounds"), list) and "question" in r for r in records):
        raise ViewerError(
            f"{path}: holds no eval trajectories (each line a question with its rounds, as `mempo-trl eval` writes "
            "them); rerun the eval, or pass a run directory or a rollout log."
        )
    for record in records:
        record.setdefault("context_mode", "memory")
    return records


def load_episodes(source: str | Path) -> Loaded:
    """The episodes of ``source``: a run directory (``rollouts/step-*.jsonl``), a ``rollouts/`` folder, one step
    file, an ``eval`` output directory or its ``trajectories.jsonl``; `ViewerError` when it holds none."""
    path, notices = Path(source), []
    if not path.exists():
        raise ViewerError(f"{path}: no such file or directory; pass a run directory, a rollout log or an eval output.")
    if path.is_file() and STEP_FILES.fullmatch(path.name):
        loaded = Loaded("training", read_step_log(path, notices), notices)
    elif path.is_file() or (path / TRAJECTORIES_FILE).is_file():
        episodes = read_trajectories(path if path.is_file() else path / TRAJECTORIES_FILE, notices)
        loaded = Loaded("training" if any("step" in e for e in episodes) else "eval", episodes, notices)
    else:
        folder = path / ROLLOUTS_DIR if (path / ROLLOUTS_DIR).is_dir() else path
        steps = sorted(p for p in folder.iterdir() if STEP_FILES.fullmatch(p.name))
        if not steps and folder == path:
            raise ViewerError(
                f"{path}: neither a run directory with a {ROLLOUTS_DIR}/ folder nor an eval output (no "
                f"{TRAJECTORIES_FILE}): train with --rollout_log_steps N to log rollouts, or pass a rollout log."
            )
        if not steps:
            raise ViewerError(
                f"{folder}: no logged steps (no step-NNNNNN.jsonl): the run ended before its first logged step "
                "(rollout_log_steps), or logged none."
            )
        loaded = Loaded("training", [e for step in steps for e in read_step_log(step, notices)], notices)
    if not loaded.episodes:
        raise ViewerError(f"{path}: its logs hold no episodes. {' '.join(notices)}".strip())
    return loaded


def split_passages(information: str | None) -> list[str]:
    """The passages of a round's result: the ``Doc i(Title: ...) ...`` entries of an ``<information>`` block, their
    ``Doc i`` dropped (so that a passage found at another rank is the same text), or the whole result as one.

    >>> split_passages("<information>Doc 1(Title: Ulm) A city.\\nDoc 2(Title: B) C.</information>")
    ['(Title: Ulm) A city.', '(Title: B) C.']
    """
    if not information:
        return []
    inner = information.removeprefix("<information>").removesuffix("</information>").strip()
    starts = [m.start() for m in _PASSAGE.finditer(inner)]
    if not starts or starts[0] != 0:
        return [inner]
    ends = starts[1:] + [len(inner)]
    return [inner[a:b].strip()[inner[a:b].index("(") :] for a, b in zip(starts, ends)]


def gold_aliases(record: dict) -> list[str]:
    """The normalised gold answers of an episode: its ``golden_answers`` and every alias of its ``sub_answers``."""
    aliases = list(record.get("golden_answers") or [])
    for part in record.get("sub_answers") or []:
        aliases += [part] if isinstance(part, str) else list(part)
    return [a for a in (normalize_answer(str(alias)) for alias in aliases) if a]


def holds_gold(passage: str, aliases: list[str]) -> bool:
    """Whether the normalised ``passage`` holds one of the normalised ``aliases`` as whole words.

    >>> holds_gold("(Title: Ulm) Born in Ulm, 1879.", ["1879"]), holds_gold("In 18790.", ["1879"])
    (True, False)
    """
    text = f" {normalize_answer(passage)} "
    return any(f" {alias} " in text for alias in aliases)


def outcome(record: dict) -> bool | None:
    """Whether the episode's answer is right: exact match when scored, else a positive reward; None when neither."""
    if record.get("em") is not None:
        return record["em"] >= 1.0
    if record.get("reward") is not None:
        return record["reward"] > 0
    return None


def page_data(loaded: Loaded, title: str) -> dict:
    """The page's data: the notices, each distinct passage once (``passages``), and per episode its step, context
    mode, K (objectives: ``objectives``, else its number of ``sub_answers``, else 1), question, gold, answer, outcome
    and numbers, and its rounds (context tokens and shown rounds, memory, thought, action, passage indices and which
    hold the gold, the memory scores and advantages)."""
    passages: dict[str, int] = {}
    episodes = []
    for record in loaded.episodes:
        aliases = gold_aliases(record)
        mode = record.get("context_mode", "memory")
        searched, rounds = [], []
        for t, r in enumerate(record["rounds"]):
            texts = split_passages(r.get("information"))
            found = [passages.setdefault(text, len(passages)) for text in texts]
            think = _THINK.search(r.get("completion") or "")
            rounds.append(
                {
                    "tokens": r.get("prompt_tokens"),
                    "shows": [s + 1 for s in shown_rounds(list(searched), mode)],
                    "mem": r.get("mem"),
                    "think": think.group(1).strip() if think else None,
                    "action": r.get("action"),
                    "content": r.get("content"),
                    "raw": None if r.get("valid") else r.get("completion"),
                    "reason": r.get("reason"),
                    "truncated": bool(r.get("truncated")),
                    "info": found,
                    "gold": [i for i, text in zip(found, texts) if holds_gold(text, aliases)],
                    **{k: r.get(k) for k in ("p_full", "p_mem", "memory_reward", "memory_advantage", "advantage")},
                }
            )
            if r.get("information") is not None:
                searched.append(t)
        k = record.get("objectives") or len(record.get("sub_answers") or []) or 1
        episodes.append(
            {
                "step": record.get("step"),
                "mode": mode,
                "k": k,
                "id": record.get("id"),
                "question": record.get("question", ""),
                "gold": list(record.get("golden_answers") or []),
                "answer": record.get("answer"),
                "right": outcome(record),
                **{n: record.get(n) for n in ("em", "f1", "reward", "outcome_advantage", "dropped")},
                "rounds": rounds,
            }
        )
    return {
        "title": title,
        "kind": loaded.kind,
        "notices": loaded.notices,
        "passages": list(passages),
        "episodes": episodes,
    }


def render_page(data: dict) -> str:
    """The page: the template with ``data`` embedded as JSON (``</`` escaped, so no text closes the script)."""
    template = files("mempo_trl").joinpath("viewer_page.html").read_text(encoding="utf-8")
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return template.replace("__TITLE__", _escape(data["title"])).replace("__DATA__", payload)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def build_page(source: str | Path, output: str | Path) -> tuple[Path, int]:
    """Write the page of ``source`` (`load_episodes`) to ``output``; returns its path and number of episodes."""
    loaded = load_episodes(source)
    data = page_data(loaded, f"mempo-trl view: {Path(source).resolve().name}")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(data), encoding="utf-8")
    return out, len(data["episodes"])
