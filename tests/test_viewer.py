"""Rollout logs and `mempo-trl view`: the logs hold the values the trainer used, are written whole, and the page built
from a real run and a real eval shows the rounds, the numbers and the filters in a real browser (headless Chromium).
Bad input ends in one `error:` line or a page that says what is missing."""

import doctest
import html
import json
import re
import statistics
import sys
import types
from pathlib import Path

import pytest
from browser import dump_dom, find_chromium, screenshot
from helpers import cpu_config, one_error_line

from mempo_trl import rollout_log, viewer
from mempo_trl.cli import main
from mempo_trl.rollout_log import RolloutLog, log_rollout_table, step_file, write_step_log


QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart_cpu.yaml"
HEADER = {"format": "mempo-trl rollouts", "version": 1, "step": 1, "context_mode": "memory", "episodes": 1}


def _round(**values):
    base = {"prompt_tokens": 30, "completion": "<mem> m </mem><think> t </think><search> q </search>", "valid": True}
    base.update(mem="m", action="search", content="q", information=None, truncated=False)
    return {**base, **values}


def _episode(**values):
    base = {
        "question": "Where was Ada born?",
        "golden_answers": ["Ulm"],
        "sub_answers": [],
        "answer": "Ulm",
        "em": 1.0,
    }
    return {**base, "rounds": [_round()], **values}


def _write_lines(path: Path, lines: list[dict], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + tail)
    return path


def test_doctests():
    assert doctest.testmod(rollout_log, optionflags=doctest.ELLIPSIS).failed == 0
    assert doctest.testmod(viewer, optionflags=doctest.ELLIPSIS).failed == 0


# ---------------------------------------------------------------- the log file


def test_a_step_file_is_replaced_whole_and_a_cut_write_leaves_the_last_whole_file(tmp_path):
    """A resumed run writing step 3 again replaces the file; a write that fails half-way (the process killed while
    writing) leaves the previous file as it was and only a temporary file, which the next run removes."""
    folder = tmp_path / "rollouts"
    write_step_log(folder, 3, {"context_mode": "memory"}, [_episode(answer="first")] * 2)
    path = write_step_log(folder, 3, {"context_mode": "memory"}, [_episode(answer="second")])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert path == step_file(folder, 3) and [line.get("answer") for line in lines] == [None, "second"]
    assert lines[0]["format"] == "mempo-trl rollouts" and lines[0]["version"] == 1 and lines[0]["episodes"] == 1
    with pytest.raises(TypeError):
        write_step_log(folder, 3, {}, [_episode(), {"not json": object()}])
    assert path.read_text().splitlines()[1:] == [json.dumps(_episode(answer="second"), ensure_ascii=False)]
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=0)
    RolloutLog(folder, 1, 4).on_train_begin(None, state, None)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000003.jsonl"]


def test_the_log_keeps_every_nth_step_and_writes_it_when_the_step_ends(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(rollout_log, "episode_log_records", lambda step, *args: [{"step": step}] * min(3, args[-1]))
    monkeypatch.setattr(
        rollout_log, "write_step_log", lambda folder, step, head, records: written.append((step, records))
    )
    log = RolloutLog(tmp_path, every=2, episodes=4)
    for step in (1, 2, 2, 3, 4):  # step 2 generates twice (gradient accumulation): 4 episodes at most
        log.record(step, None, None, None, None, ())
    assert sorted(log.pending) == [2, 4] and len(log.pending[2]) == 4
    log.on_step_end(None, types.SimpleNamespace(global_step=2), None)
    assert [(step, len(records)) for step, records in written] == [(2, 4)] and sorted(log.pending) == [4]


def test_the_tracker_table_has_one_row_per_round(monkeypatch):
    """As TRL logs its completions table: `wandb.log({"rollouts": wandb.Table(dataframe=...)})` when a run is on."""
    logged = []
    fake = types.SimpleNamespace(run=object(), log=logged.append, Table=lambda dataframe: dataframe)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    records = [{**_episode(step=5), "rounds": [_round(p_mem=0.5), _round(mem="m2", p_mem=0.25)]}, {**_episode(step=5)}]
    log_rollout_table(["wandb"], records)
    frame = logged[0]["rollouts"]
    assert list(frame["round"]) == [1, 2, 1] and list(frame["episode"]) == [0, 0, 1] and set(frame["step"]) == {5}
    assert list(frame["mem"]) == ["m", "m2", "m"] and frame["p_mem"].tolist()[:2] == [0.5, 0.25]
    assert frame["golden_answers"][0] == '["Ulm"]'
    fake.run = None
    log_rollout_table(["wandb"], records)
    log_rollout_table(["none"], records)
    assert len(logged) == 1


def test_rollout_log_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="rollout_log_steps must be >= 0, got -1"):
        cpu_config(tmp_path, rollout_log_steps=-1)
    with pytest.raises(ValueError, match="rollout_log_episodes must be >= 1, got 0"):
        cpu_config(tmp_path, rollout_log_episodes=0)


# ---------------------------------------------------------------- the page's data


def test_passages_are_stored_once_and_the_gold_ones_marked(tmp_path):
    information = (
        "<information>Doc 1(Title: Ada) Ada was born in Ulm.\nDoc 2(Title: Bo) Bo was born in Ulmen.</information>"
    )
    again = "<information>Doc 1(Title: Bo) Bo was born in Ulmen.</information>"
    rounds = [
        _round(information=information),
        _round(information=again, mem="m Ulm"),
        _round(mem="Ulm", action="answer"),
    ]
    lines = [{**HEADER, "episodes": 2}, _episode(rounds=rounds), _episode(rounds=rounds[:1], em=0.0)]
    path = _write_lines(tmp_path / "step-000001.jsonl", lines)
    data = viewer.page_data(viewer.load_episodes(path), "t")
    assert data["passages"] == ["(Title: Ada) Ada was born in Ulm.", "(Title: Bo) Bo was born in Ulmen."]
    first = data["episodes"][0]["rounds"]
    assert [r["info"] for r in first] == [[0, 1], [1], []] and [r["gold"] for r in first] == [[0], [], []]
    assert [r["shows"] for r in first] == [[], [1], [2]]  # memory mode: the last searched round
    assert [e["right"] for e in data["episodes"]] == [True, False] and data["episodes"][0]["k"] == 1


def test_eval_records_of_both_modes_and_k_from_sub_answers_or_objectives(tmp_path):
    rounds = [_round(information="<information>Doc 1(Title: A) x.</information>")] * 2 + [_round(action="answer")]
    lines = [
        {"context_mode": mode, **_episode(rounds=rounds, sub_answers=[["Ulm"], ["1879"]])}
        for mode in ("memory", "full_history")
    ] + [{"context_mode": "memory", "objectives": 4, **_episode()}]
    data = viewer.page_data(viewer.load_episodes(_write_lines(tmp_path / "trajectories.jsonl", lines).parent), "t")
    assert data["kind"] == "eval" and [e["k"] for e in data["episodes"]] == [2, 2, 4]
    assert [r["shows"] for r in data["episodes"][1]["rounds"]] == [[], [1], [1, 2]]  # full history: every one
    assert [r["shows"] for r in data["episodes"][0]["rounds"]] == [[], [1], [2]]


# ---------------------------------------------------------------- bad input: one error line, or a page that says


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing", "no such file or directory"),
        (lambda d: d, "neither a run directory with a rollouts/ folder nor an eval output"),
        (lambda d: (d / "rollouts").mkdir() or d, "no logged steps"),
        (
            lambda d: (
                _write_lines(
                    d / "rollouts" / "step-000002.jsonl", [{**HEADER, "version": 2}, _episode()]
                ).parent.parent
            ),
            "rollout log version 2, but this mempo_trl reads version 1",
        ),
        (lambda d: _write_lines(d / "step-000001.jsonl", [_episode()]), "not a mempo-trl rollout log"),
        (lambda d: _write_lines(d / "trajectories.jsonl", [{"question": "q"}]), "holds no eval trajectories"),
        (
            lambda d: _write_lines(d / "rollouts" / "step-000001.jsonl", [HEADER], tail='{"question": "cut'),
            "its logs hold no episodes. step-000001.jsonl: its last line (line 2) is cut short",
        ),
    ],
    ids=["missing", "not-a-run", "no-steps", "other-version", "no-header", "not-eval", "only-a-cut-line"],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, make, needle):
    source = make(tmp_path)
    assert main(["view", str(source), "--output", str(tmp_path / "page.html")]) == 2
    assert needle in one_error_line(capsys)
    assert not (tmp_path / "page.html").exists()


def test_no_source_is_one_error_line(capsys):
    assert main(["view", "--output", "x.html"]) == 2
    assert "no source: mempo-trl view RUN_DIR_OR_ROLLOUT_LOG_OR_EVAL_OUTPUT" in one_error_line(capsys)


def test_a_cut_last_line_and_missing_episodes_are_said_on_the_page(tmp_path, capsys):
    lines = [{**HEADER, "episodes": 3}, _episode(step=1), _episode(step=1, answer="Bonn")]
    _write_lines(tmp_path / "run" / "rollouts" / "step-000001.jsonl", lines, tail='{"question": "Wh')
    assert main(["view", str(tmp_path / "run"), "--output", str(tmp_path / "page.html")]) == 0
    assert "wrote " in capsys.readouterr().out
    page = (tmp_path / "page.html").read_text()
    assert "step-000001.jsonl: its last line (line 4) is cut short and was skipped." in page
    assert "step-000001.jsonl: 2 of the 3 episodes its header lists were read." in page


# ---------------------------------------------------------------- a real run and a real eval, in a real browser


def _train_argv(kit: Path, run: Path) -> list[str]:
    """A 2-step training run of the shipped learner: 8 episodes a step, a checkpoint after each, the rollout log on
    every step with 6 episodes kept."""
    world = kit / "world"
    argv = ["train", "--config", str(QUICKSTART), "--model_name_or_path", str(kit / "model"), "--output_dir", str(run)]
    argv += ["--dataset_name", str(world), "--corpus", str(world / "corpus.jsonl"), "--heldout_questions", "0"]
    argv += ["--max_steps", "2", "--per_device_train_batch_size", "8", "--save_strategy", "steps", "--save_steps", "1"]
    return [*argv, "--rollout_log_steps", "1", "--rollout_log_episodes", "6"]


def _real_outputs(root: Path) -> tuple[Path, Path]:
    """The training run of `_train_argv` and an eval of its model in both context modes on 5 held-out questions."""
    kit, run, evaluation = root / "kit", root / "run", root / "eval"
    assert main(["kit", "learner", "--output_dir", str(kit)]) == 0
    world = kit / "world"
    assert main(_train_argv(kit, run)) == 0
    argv = ["eval", "--model_name_or_path", str(run), "--dataset_name", str(world / "test.jsonl"), "--corpus"]
    argv += [str(world / "corpus.jsonl"), "--output_dir", str(evaluation), "--max_eval_samples", "5"]
    assert main([*argv, "--context_mode", "both", "--disable_tqdm", "true"]) == 0
    return run, evaluation


def _pool_advantages(values: list[float], eps: float) -> list[float]:
    """(r - mean) / (std + eps), unbiased std, as GRPO and the memory pools normalise (mean 0, std 1 for one value)."""
    mean, std = (statistics.mean(values), statistics.stdev(values)) if len(values) > 1 else (0.0, 1.0)
    return [(v - mean) / (std + eps) if std > 0 else v - mean for v in values]


def _check_log(run: Path) -> None:
    """Per step: the header, 6 of the 8 episodes, every round; the first group's outcome advantages and memory
    advantages recomputed by hand from its logged rewards, the advantage on `<mem>` = outcome + coef x memory."""
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    scored = 0
    for step in (1, 2):
        head, *episodes = [json.loads(line) for line in step_file(run / "rollouts", step).read_text().splitlines()]
        assert (head["step"], head["episodes"], head["context_mode"], head["num_generations"]) == (
            step,
            6,
            "memory",
            4,
        )
        assert len(episodes) == 6 and {e["step"] for e in episodes} == {step}
        group = episodes[:4]  # one question's G = 4 episodes
        assert len({e["question"] for e in group}) == 1
        expected = _pool_advantages([e["reward"] for e in group], 1e-4)
        assert [e["outcome_advantage"] for e in group] == pytest.approx(expected, abs=1e-4)
        rounds = [r for e in group for r in e["rounds"] if r["memory_reward"] is not None]
        memory = _pool_advantages([r["memory_reward"] for r in rounds], 1e-6)
        assert [r["memory_advantage"] for r in rounds] == pytest.approx(memory, abs=1e-4)
        for e in episodes:
            assert e["num_turns"] == len(e["rounds"]) and e["reward"] == e["rewards"]["mempo_outcome_reward"]
            for t, r in enumerate(e["rounds"]):
                assert r["prompt_tokens"] > 0 and (r["p_mem"] is None) == (r["memory_reward"] is None)
                if r["memory_reward"] is not None:
                    scored += 1
                    assert t >= 1 and r["memory_reward"] == pytest.approx(r["p_mem"] - r["p_full"], abs=1e-6)
                    assert r["advantage"] == pytest.approx(e["outcome_advantage"] + r["memory_advantage"], abs=1e-4)
                elif r["mem"] is not None:
                    assert r["advantage"] == pytest.approx(e["outcome_advantage"], abs=1e-4)
    assert scored > 0


def _cards(dom: str) -> list[str]:
    """The episode cards of a dumped page, each as its HTML."""
    return re.split(r'(?=<div class="episode)', dom)[1:]


def _attribute(card: str, name: str) -> str:
    return re.search(rf'data-{name}="([^"]*)"', card).group(1)


def _check_resume(run: Path, kit: Path) -> None:
    """Resumed from its step-1 checkpoint, the run plays step 2 again: step 2's file is replaced whole (a new file
    renamed over it), step 1's is left as it was, and no temporary file is left."""
    files = {step: step_file(run / "rollouts", step) for step in (1, 2)}
    before = {step: path.stat().st_ino for step, path in files.items()}
    assert main([*_train_argv(kit, run), "--resume_from_checkpoint", str(run / "checkpoint-1")]) == 0
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    assert files[1].stat().st_ino == before[1] and files[2].stat().st_ino != before[2]
    head, *episodes = [json.loads(line) for line in files[2].read_text().splitlines()]
    assert head["step"] == 2 and len(episodes) == head["episodes"] == 6


def _check_run_page(run: Path, tmp_path: Path, capsys) -> None:
    """The rounds, the numbers, the memory diff, the gold passages and the filters, as Chromium draws them."""
    page = tmp_path / "run.html"
    assert main(["view", str(run), "--output", str(page)]) == 0
    assert "(12 episodes" in capsys.readouterr().out
    episodes = [
        json.loads(line) for step in (1, 2) for line in step_file(run / "rollouts", step).read_text().splitlines()[1:]
    ]
    dom = dump_dom(page)
    cards = _cards(dom)
    assert len(cards) == 12 and "showing 1–12 of 12 episodes" in dom
    assert not re.search(r"(src|href)=\S*https?:|<link|@import", page.read_text())  # nothing to fetch
    for card, episode in zip(cards, episodes):
        assert _attribute(card, "step") == str(episode["step"])
        assert _attribute(card, "right") == ("1" if episode["em"] == 1 else "0")
        assert card.count('class="round"') == len(episode["rounds"])
        tokens = [int(n) for n in re.findall(r"context (\d+) tokens", card)]
        assert tokens == [r["prompt_tokens"] for r in episode["rounds"]]
        shown = [float(x) for x in re.findall(r'data-name="p_mem">P_mem (-?[\d.]+)<', card)]
        assert shown == [round(r["p_mem"], 3) for r in episode["rounds"] if r["p_mem"] is not None]
        advantages = re.findall(r'data-name="advantage">advantage on &lt;mem&gt; ([-+]?[\d.]+)<', card)
        assert [float(a) for a in advantages] == [
            round(r["advantage"], 3) for r in episode["rounds"] if r["advantage"] is not None
        ]
        first_mem = re.search(r'<div class="mem"[^>]*>(.*?)</div>', card).group(1)
        assert "<del>" not in first_mem and first_mem.count("<ins>") == len(episode["rounds"][0]["mem"].split())
        for passage in re.findall(r'<li class="passage gold">(.*?)</li>', card):
            aliases = episode["golden_answers"] + [a for part in episode["sub_answers"] for a in part]
            assert any(alias.lower() in html.unescape(passage).lower() for alias in aliases)
    assert 'class="passage gold"' in dom
    changed = [
        (a["mem"], b["mem"]) for e in episodes for a, b in zip(e["rounds"], e["rounds"][1:]) if a["mem"] != b["mem"]
    ]
    assert (
        not changed or "<del>" in dom or dom.count("<ins>") > sum(len(e["rounds"][0]["mem"].split()) for e in episodes)
    )

    right_2 = [e for e in episodes if e["step"] == 2 and e["em"] == 1]
    filtered = _cards(dump_dom(page, "outcome=right&step=2"))
    assert len(filtered) == len(right_2)
    assert all(_attribute(c, "right") == "1" and _attribute(c, "step") == "2" for c in filtered)
    two_parts = _cards(dump_dom(page, "k=2"))
    assert len(two_parts) == sum(len(e["sub_answers"]) == 2 for e in episodes)
    assert "No episode matches these filters." in dump_dom(page, "k=99")

    shot = screenshot(page, tmp_path / "viewer.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def _check_eval_page(evaluation: Path, tmp_path: Path) -> None:
    """Each question's two context modes side by side, their context sizes and shown rounds; the outcome filter."""
    page = tmp_path / "eval.html"
    assert main(["view", str(evaluation), "--output", str(page)]) == 0
    records = [json.loads(line) for line in (evaluation / "trajectories.jsonl").read_text().splitlines()]
    dom = dump_dom(page)
    pairs = re.split(r'(?=<div class="group)', dom)[1:]
    assert len(pairs) == 5 and all('class="group pair"' in p for p in pairs) and "showing 1–5 of 5 questions" in dom
    for pair in pairs:
        assert [_attribute(c, "mode") for c in _cards(pair)] == ["memory", "full_history"]
    by_mode = {mode: [r for r in records if r["context_mode"] == mode] for mode in ("memory", "full_history")}
    for i, pair in enumerate(pairs):
        for card, mode in zip(_cards(pair), ("memory", "full_history")):
            record = by_mode[mode][i]
            assert [int(n) for n in re.findall(r"context (\d+) tokens", card)] == [
                r["prompt_tokens"] for r in record["rounds"]
            ]
            searched = [t + 1 for t, r in enumerate(record["rounds"][:-1]) if r["information"] is not None]
            if mode == "full_history" and len(searched) >= 2:
                assert f"question + rounds {', '.join(map(str, searched))}, full_history" in card
    right = sum(any(by_mode[mode][i]["em"] == 1 for mode in by_mode) for i in range(5))
    assert len(re.split(r'(?=<div class="group)', dump_dom(page, "outcome=right"))[1:]) == right


@pytest.mark.slow
def test_a_real_run_and_its_eval_logged_resumed_and_seen_in_chromium(tmp_path, capsys):
    """One test (the run is trained once, whatever the test workers): the log of a real run, its resume, and the
    pages of the run and of its eval in headless Chromium, with a screenshot."""
    run, evaluation = _real_outputs(tmp_path)
    _check_log(run)
    _check_resume(run, tmp_path / "kit")
    if find_chromium() is None:
        pytest.skip("no Chromium found (apt-get install chromium): the viewer's browser checks need one")
    _check_run_page(run, tmp_path, capsys)
    _check_eval_page(evaluation, tmp_path)


def test_a_rollout_log_under_another_name_is_read_as_one(tmp_path):
    """Found by its header, not its name: its episodes are training episodes, each its own (not paired by question)."""
    path = _write_lines(tmp_path / "copy.jsonl", [{**HEADER, "episodes": 2}, _episode(step=1), _episode(step=1)])
    loaded = viewer.load_episodes(path)
    assert loaded.kind == "training" and [e["step"] for e in loaded.episodes] == [1, 1]
