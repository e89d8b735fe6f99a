"""The evaluation harness: metrics on a scripted policy, exact token accounting, generation backends, the CLI."""

import importlib.util
import json
import math
import re
from collections import defaultdict

import pytest
from helpers import EchoRetriever, free_port

from mempo_trl.agent import MemPOAgent
from mempo_trl.cli import main
from mempo_trl.context import initial_messages, render_information, render_prompt
from mempo_trl.evaluation import HELDOUT_OVERALL, compare_modes, evaluate, heldout_metrics
from mempo_trl.generation import HFGenerator, strip_completion
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.loading import load_tokenizer
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import Passage
from mempo_trl.turns import stop_token_ids


DEMO = demo_paths()


_QUESTION = re.compile(r"Question: (.*?)<\|im_end\|>", re.DOTALL)


class Script:
    """`GenerateFn` playing a fixed list of turn texts per question (found in the prompt), one per call."""

    def __init__(self, tokenizer, turns: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.turns = turns
        self.played = defaultdict(int)

    def __call__(self, prompts):
        out = []
        for ids in prompts:
            question = _QUESTION.search(self.tokenizer.decode(ids, skip_special_tokens=False)).group(1)
            out.append(self.tokenizer(self.turns[question][self.played[question]], add_special_tokens=False).input_ids)
            self.played[question] += 1
        return out, None


def turn(action: str, content: str, mem: str = "notes") -> str:
    return f"<mem> {mem} </mem>\n<think> thinking </think>\n<{action}> {content} </{action}>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "cache"))


# ---------------------------------------------------------------- metrics on a scripted policy

METRIC_ROWS = [
    {"question": "Where is the Eiffel Tower?", "golden_answers": ["Paris"], "data_source": "a"},
    {"question": "What is the capital of France?", "golden_answers": ["Paris"], "data_source": "a"},
    {"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare", "William Shakespeare"], "data_source": "a"},
    {"question": "Which ocean is the largest?", "golden_answers": ["Pacific"], "data_source": "b"},
    {
        "question": "1. Where was Ada born?\n2. Who is Ada's brother?",
        "golden_answers": ["Ulm; Max"],
        "sub_answers": [["Ulm"], ["Max"]],
        "data_source": "b",
    },
    {"question": "Who founded Orbix?", "golden_answers": ["Vera Holt"], "data_source": "b"},
]

METRIC_SCRIPT = {
    "Where is the Eiffel Tower?": [turn("answer", "Paris")],  # right
    "What is the capital of France?": [turn("search", "France capital"), turn("answer", "Paris France")],  # partial
    "Who wrote Hamlet?": [turn("answer", "Marlowe")],  # wrong
    "Which ocean is the largest?": ["<think> easy </think>\n<answer> Pacific </answer>"],  # right text, no <mem>
    "1. Where was Ada born?\n2. Who is Ada's brother?": [turn("answer", "Ulm; Bob")],  # one of two
    "Who founded Orbix?": [turn("search", "Orbix"), turn("search", "Orbix founder"), turn("search", "Orbix history")],
}


def test_scripted_policy_metrics(tokenizer):
    retriever = EchoRetriever()
    agent = MemPOAgent(
        tokenizer, retriever, Script(tokenizer, METRIC_SCRIPT), TurnProtocol(max_turns=3, retrieval_topk=2)
    )
    result = evaluate(agent, METRIC_ROWS, progress=False)
    per_question = [(r["em"], round(r["f1"], 6), r["sub_em"], r["format_valid"]) for r in result.records]
    assert per_question == [
        (1.0, 1.0, 1.0, True),
        (0.0, round(2 / 3, 6), 1.0, True),
        (0.0, 0.0, 0.0, True),
        (0.0, 0.0, 0.0, False),
        (0.5, 0.5, 0.5, True),
        (0.0, 0.0, 0.0, False),
    ]
    assert [r["answer"] for r in result.records] == ["Paris", "Paris France", "Marlowe", None, "Ulm; Bob", None]
    # All parts: a question's worst part (one of two right scores 0), the same as EM/F1 on single questions.
    all_parts = [(r["em_all_parts"], round(r["f1_all_parts"], 6)) for r in result.records]
    assert all_parts == [(1.0, 1.0), (0.0, round(2 / 3, 6)), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)]
    # The last allowed round's search is not run: Orbix searches twice in three rounds.
    assert retriever.queries == ["France capital", "Orbix", "Orbix founder"]

    overall = result.metrics["overall"]
    assert overall["num_questions"] == 6
    assert overall["em"] == pytest.approx(1.5 / 6)
    assert overall["f1"] == pytest.approx((1 + 2 / 3 + 0.5) / 6)
    assert overall["sub_em"] == pytest.approx(2.5 / 6)
    assert overall["em_all_parts"] == pytest.approx(1 / 6)
    assert overall["f1_all_parts"] == pytest.approx((1 + 2 / 3) / 6)
    assert overall["format_valid"] == pytest.approx(4 / 6)
    assert overall["turns_valid"] == pytest.approx(5 / 6)
    assert overall["turns_per_question"] == pytest.approx(9 / 6)
    assert overall["searches_per_question"] == pytest.approx(3 / 6)
    assert overall["questions_per_round"] == [6, 2, 1]

    by_source = result.metrics["by_data_source"]
    assert sorted(by_source) == ["a", "b"]
    a, b = by_source["a"], by_source["b"]
    assert (a["num_questions"], b["num_questions"]) == (3, 3)
    assert a["em"] == pytest.approx(1 / 3) and b["em"] == pytest.approx(0.5 / 3)
    assert a["f1"] == pytest.approx((1 + 2 / 3) / 3) and b["f1"] == pytest.approx(0.5 / 3)
    assert a["sub_em"] == pytest.approx(2 / 3) and b["sub_em"] == pytest.approx(0.5 / 3)
    assert a["format_valid"] == 1.0 and b["format_valid"] == pytest.approx(1 / 3)
    assert a["turns_per_question"] == pytest.approx(4 / 3) and b["turns_per_question"] == pytest.approx(5 / 3)
    assert a["searches_per_question"] == pytest.approx(1 / 3) and b["searches_per_question"] == pytest.approx(2 / 3)


def test_heldout_metrics_average_a_pluggable_row_metric(tokenizer):
    """`heldout_metrics` over the scripted episodes: the default row metric is the episodes' EM and F1; another one
    is averaged over the rows that give a value (None and NaN do not count), nested values key by key, per type."""
    agent = MemPOAgent(
        tokenizer, EchoRetriever(), Script(tokenizer, METRIC_SCRIPT), TurnProtocol(max_turns=3, retrieval_topk=2)
    )
    result = evaluate(agent, METRIC_ROWS, progress=False)
    default = heldout_metrics(result, METRIC_ROWS)
    assert (default["em"], default["f1"]) == pytest.approx((1.5 / 6, (1 + 2 / 3 + 0.5) / 6))
    assert default["format_valid"] == pytest.approx(4 / 6) and default["turns_per_question"] == pytest.approx(9 / 6)
    assert default["by_type"] == {
        "a": pytest.approx({"em": 1 / 3, "f1": (1 + 2 / 3) / 3}),
        "b": pytest.approx({"em": 0.5 / 3, "f1": 0.5 / 3}),
    }
    assert "memory_recall" not in default  # the library measures no memory recall of its own

    def answered(row, record):  # None for the rows whose question has no "the": not counted
        counted = " the " in f" {row['question']} "
        return {
            "answered": float(record["answer"] is not None) if counted else None,
            "kind": {"hit": record["em"], "miss": 1.0 - record["em"]},
            "nan": math.nan,
        }

    custom = heldout_metrics(result, METRIC_ROWS, answered)
    # "the" rows: Eiffel (answered), capital (answered), largest (no answer) -> 2 / 3.
    assert custom["answered"] == pytest.approx(2 / 3) and math.isnan(custom["nan"])
    assert custom["kind"] == pytest.approx({"hit": 1.5 / 6, "miss": 4.5 / 6})
    assert custom["by_type"]["a"]["answered"] == 1.0 and custom["by_type"]["b"]["answered"] == 0.0
    assert custom["by_type"]["b"]["kind"] == pytest.approx({"hit": 0.5 / 3, "miss": 2.5 / 3})
    assert {k: custom[k] for k in HELDOUT_OVERALL} == {k: default[k] for k in HELDOUT_OVERALL}  # always there


def test_heldout_callback_evaluates_before_at_intervals_and_after(tiny_model_dir, tokenizer):
    """`HeldOutEvalCallback` on the tiny model: step 0, every `eval_every` steps, the last step once; each evaluation
    goes to `on_result`, and `before_after` compares the first with the last."""
    from types import SimpleNamespace

    from mempo_trl.callbacks import HeldOutEvalCallback

    model, _ = load_tiny(tiny_model_dir)
    rows = METRIC_ROWS[:2]
    reported = []
    callback = HeldOutEvalCallback(
        tokenizer,
        rows,
        EchoRetriever(),
        eval_every=2,
        on_result=lambda curve: reported.append(curve[-1]["step"]),
        row_metric=lambda row, record: {"turns": float(record["num_turns"])},
        protocol=TurnProtocol(max_turns=2, max_completion_length=8),
    )
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    callback.on_train_begin(None, state, None, model=model)
    for step in (1, 2, 3, 4):
        state.global_step = step
        callback.on_step_end(None, state, None, model=model)
    callback.on_train_end(None, state, None, model=model)
    assert [point["step"] for point in callback.curve] == reported == [0, 2, 4]
    first = callback.curve[0]
    assert first["turns"] == first["turns_per_question"] and first["by_type"]["a"]["turns"] == first["turns"]
    assert first["em"] == 0.0 and first["eval_seconds"] > 0  # random weights answer nothing
    assert callback.before_after() == (
        "held-out EM (2 questions, greedy): 0.000 before training (step 0) -> 0.000 after (step 4) | format "
        f"{first['format_valid']:.3f} -> {callback.curve[-1]['format_valid']:.3f}"
    )


# ---------------------------------------------------------------- token accounting against a hand count


def test_token_counts_match_a_hand_count(tokenizer):
    question = "Who founded Orbix?"
    texts = [turn("search", "alpha", mem="m1"), turn("search", "beta", mem="m2 longer"), turn("answer", "Vera Holt")]
    rows = [{"question": question, "golden_answers": ["Vera Holt"]}]
    completions = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert [tokenizer.decode(c) for c in completions] == texts  # the rollout sees exactly these texts
    info = [render_information([Passage(id=q, title=f"T {q}", text=f"about {q}")]) for q in ("alpha", "beta")]

    base = initial_messages(question)
    turn1 = [{"role": "assistant", "content": texts[0]}, {"role": "tool", "content": info[0]}]
    turn2 = [{"role": "assistant", "content": texts[1]}, {"role": "tool", "content": info[1]}]
    expected_prompts = {
        "memory": [render_prompt(tokenizer, m) for m in (base, base + turn1, base + turn2)],
        "full_history": [render_prompt(tokenizer, m) for m in (base, base + turn1, base + turn1 + turn2)],
    }
    assert len(expected_prompts["full_history"][2]) > len(expected_prompts["memory"][2])

    results = {}
    for mode, prompts in expected_prompts.items():
        agent = MemPOAgent(tokenizer, EchoRetriever(), Script(tokenizer, {question: texts}), TurnProtocol(max_turns=3))
        result = evaluate(agent, rows, context_mode=mode, progress=False)
        record = result.records[0]
        assert [r.prompt_ids for r in result.episodes[0].rounds] == prompts
        assert [r["prompt_tokens"] for r in record["rounds"]] == [len(p) for p in prompts]
        assert [r["completion_tokens"] for r in record["rounds"]] == [len(c) for c in completions]
        per_round = [len(p) + len(c) for p, c in zip(prompts, completions)]
        assert record["peak_context_tokens"] == max(per_round)
        assert record["total_tokens"] == sum(per_round)
        assert result.metrics["overall"]["prompt_tokens_per_round"] == [len(p) for p in prompts]
        assert record["em"] == 1.0 and record["num_searches"] == 2
        results[mode] = result

    totals = {mode: r.records[0]["total_tokens"] for mode, r in results.items()}
    comparison = compare_modes(results["memory"], results["full_history"])
    assert comparison["total_token_reduction_pct"] == pytest.approx(
        100 * (1 - totals["memory"] / totals["full_history"])
    )
    assert comparison["f1_delta"] == 0.0


# ---------------------------------------------------------------- generation backend


def test_stop_ids_and_strip(tokenizer):
    ids = stop_token_ids(tokenizer)
    tags = {tokenizer.convert_tokens_to_ids(t) for t in ("</search>", "</answer>")}
    assert tags <= set(ids) and tokenizer.eos_token_id in ids
    assert strip_completion([7, 8, 9], stop_ids=[2]) == [7, 8, 9]
    assert strip_completion([7, 2, 9, 2], stop_ids=[2]) == [7, 2]


def test_hf_generator_batched_equals_one_by_one(tiny_model_dir, tokenizer):
    model, _ = load_tiny(tiny_model_dir)
    prompts = [render_prompt(tokenizer, initial_messages(q)) for q in ("Who?", "Where was Ada Lovelace born?", "Ada")]
    assert len({len(p) for p in prompts}) == 3
    batched, logprobs = HFGenerator(model, tokenizer, max_new_tokens=12, batch_size=3)(prompts)
    single = [HFGenerator(model, tokenizer, max_new_tokens=12, batch_size=1)([p])[0][0] for p in prompts]
    assert logprobs is None
    assert batched == single
    assert all(0 < len(c) <= 12 for c in batched)


def test_hf_generator_stops_on_a_single_token_action_tag(tiny_model_dir, tokenizer):
    import torch

    model, _ = load_tiny(tiny_model_dir)
    stop = tokenizer.convert_tokens_to_ids("</search>")
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[stop] = 1e4
    model.lm_head = head
    model.train()
    prompts = [render_prompt(tokenizer, initial_messages(q)) for q in ("a", "a longer question")]
    completions, _ = HFGenerator(model, tokenizer, max_new_tokens=16, batch_size=2)(prompts)
    assert completions == [[stop], [stop]]
    assert model.training  # restored after generating in eval mode


# ---------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_end_to_end_both_modes(tiny_model_dir, tmp_path, cache, capsys):
    import matplotlib.image

    out = tmp_path / "eval"
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--max_eval_samples", "8"]
    argv += ["--dataset_name", str(DEMO.test), "--corpus", str(DEMO.corpus)]
    argv += ["--max_turns", "2", "--max_completion_length", "24", "--context_mode", "both"]
    assert main([*argv, "--per_device_eval_batch_size", "3", "--disable_tqdm", "true"]) == 0
    assert "memory vs full_history" in capsys.readouterr().out

    report = json.loads((out / "results.json").read_text())
    settings = report["settings"]
    assert settings["context_modes"] == ["memory", "full_history"]
    agent = settings["protocol"]
    assert (agent["max_turns"], agent["retrieval_topk"], settings["num_questions"]) == (2, 3, 8)
    assert settings["retriever"]["kind"] == "bm25" and settings["retriever"]["num_passages"] > 0
    assert {"torch", "transformers", "trl", "mempo_trl"} <= set(report["versions"])
    assert set(report["modes"]) == {"memory", "full_history"}
    assert "total_token_reduction_pct" in report["comparison"]

    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [r["context_mode"] for r in lines] == ["memory"] * 8 + ["full_history"] * 8
    for mode in ("memory", "full_history"):
        records = [r for r in lines if r["context_mode"] == mode]
        overall = report["modes"][mode]["overall"]
        assert overall["num_questions"] == 8
        assert overall["total_tokens"] == sum(r["total_tokens"] for r in records)
        assert overall["em"] == pytest.approx(sum(r["em"] for r in records) / 8)
        for r in records:
            sizes = [x["prompt_tokens"] + x["completion_tokens"] for x in r["rounds"]]
            assert 1 <= r["num_turns"] == len(r["rounds"]) <= 2
            assert r["total_tokens"] == sum(sizes) and r["peak_context_tokens"] == max(sizes)
            assert all(x["completion_tokens"] <= 24 for x in r["rounds"])
    assert (
        sum(
            report["modes"]["memory"]["by_data_source"][s]["num_questions"]
            for s in report["modes"]["memory"]["by_data_source"]
        )
        == 8
    )
    image = matplotlib.image.imread(out / "context_tokens.png")
    assert image.ndim == 3 and image.shape[0] > 100


def test_cli_several_sources_limit_and_default_data_source(tiny_model_dir, tmp_path, cache, capsys):
    files = []
    for name, n in (("nq_dev", 3), ("hotpot_dev", 2)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"question": f"q{k} of {name}?", "golden_answers": ["x"]}) + "\n" for k in range(n))
        )
        files.append(str(path))
    out = tmp_path / "eval"
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", *files, "--max_eval_samples", "2"]
    argv += ["--output_dir", str(out), "--max_turns", "1", "--max_completion_length", "4", "--disable_tqdm", "true"]
    argv += ["--corpus", str(DEMO.corpus)]
    assert main(argv) == 0
    metrics = json.loads((out / "results.json").read_text())["modes"]["memory"]
    assert {s: m["num_questions"] for s, m in metrics["by_data_source"].items()} == {"nq_dev": 2, "hotpot_dev": 2}
    assert metrics["overall"]["num_questions"] == 4


@pytest.mark.parametrize(
    "problem", ["no_golden_answers", "unreachable_retriever", "missing_model", "not_a_model_dir", "missing_corpus"]
)
def test_cli_bad_inputs_print_one_line(problem, tiny_model_dir, tmp_path, cache, capsys):
    model = str(tiny_model_dir)
    extra, expected = [], []
    if problem == "no_golden_answers":
        data = tmp_path / "qa.jsonl"
        data.write_text(json.dumps({"question": "Who?", "answer": "Ada"}) + "\n")
        extra, expected = ["--dataset_name", str(data)], [str(data), "line 1", "golden_answers"]
    elif problem == "unreachable_retriever":
        url = f"http://127.0.0.1:{free_port()}"
        extra = ["--retriever_url", url, "--retriever_timeout", "2", "--retriever_max_retries", "0"]
        expected = [url, "refused", "serve-retriever"]
    elif problem == "missing_model":
        model = str(tmp_path / "no_such_model")
        expected = [model, "does not exist", "save_pretrained"]
    elif problem == "not_a_model_dir":
        (tmp_path / "not_a_model").mkdir()
        model = str(tmp_path / "not_a_model")
        expected = [model, "config.json"]
    else:
        corpus = str(tmp_path / "missing.jsonl")
        extra, expected = ["--corpus", corpus], [corpus]
    code = main(
        [
            "eval",
            "--model_name_or_path",
            model,
            "--output_dir",
            str(tmp_path / "out"),
            "--dataset_name",
            str(DEMO.test),
            "--corpus",
            str(DEMO.corpus),
            *extra,
        ]
    )
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert all(part in lines[0] for part in expected), lines[0]
    assert "Traceback" not in captured.err and not any((tmp_path / "out").glob("*"))  # nothing written


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_cli_vllm_backend_without_vllm(tiny_model_dir, tmp_path, cache, capsys):
    code = main(
        [
            "eval",
            "--model_name_or_path",
            str(tiny_model_dir),
            "--output_dir",
            str(tmp_path),
            "--use_vllm",
            "true",
            "--dataset_name",
            str(DEMO.test),
            "--corpus",
            str(DEMO.corpus),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "mempo_trl[vllm]" in lines[0]


def test_summary_means_are_over_questions_reaching_a_round(tokenizer):
    rows = [{"question": q, "golden_answers": ["x"]} for q in ("one round?", "two rounds?")]
    script = {"one round?": [turn("answer", "x")], "two rounds?": [turn("search", "s"), turn("answer", "x")]}
    agent = MemPOAgent(tokenizer, EchoRetriever(), Script(tokenizer, script), TurnProtocol(max_turns=4))
    result = evaluate(agent, rows, progress=False)
    first, second = result.records
    means = result.metrics["overall"]["prompt_tokens_per_round"]
    assert means[0] == (first["rounds"][0]["prompt_tokens"] + second["rounds"][0]["prompt_tokens"]) / 2
    assert means[1] == second["rounds"][1]["prompt_tokens"]
    assert not math.isnan(result.metrics["overall"]["mean_prompt_tokens"])


def test_progress_counts_the_turns_written_within_a_round():
    from mempo_trl.evaluation import _Progress

    class Batched:
        on_batch = None

        def __call__(self, prompts):
            for start in range(0, len(prompts), 2):
                self.on_batch(len(prompts[start : start + 2]))
            return [[] for _ in prompts], None

    generate = Batched()
    progress = _Progress(generate, total=5, max_turns=3, desc="eval", enabled=True)
    seen = []
    progress.bar.set_postfix_str = seen.append
    progress([[1]] * 5)
    assert seen == [
        "round 1/3, 0/5 turns written",
        "round 1/3, 2/5 turns written",
        "round 1/3, 4/5 turns written",
        "round 1/3, 5/5 turns written",
    ]
    progress([[1]] * 2)
    assert progress.bar.n == 3 and seen[-1] == "round 2/3, 2/2 turns written"
    progress.close()
    assert generate.on_batch is None  # the generator is left as it was


def test_hf_generator_reports_each_finished_batch(tiny_model_dir):
    from mempo_trl.generation import HFGenerator

    model, tokenizer = load_tiny(tiny_model_dir)
    generate = HFGenerator(model, tokenizer, max_new_tokens=2, batch_size=2)
    sizes = []
    generate.on_batch = sizes.append
    completions, _ = generate([[1, 2], [3], [4, 5, 6]])
    assert sizes == [2, 1] and len(completions) == 3


def test_progress_counts_the_turns_written_within_one_batch(tiny_model_dir):
    """One batch of 3 prompts: the bar moves as each row ends (SmolLM2's recipe evaluates 20 questions in one batch,
    and the bar showed 0/20 for the whole round)."""
    from mempo_trl.evaluation import _Progress
    from mempo_trl.generation import HFGenerator

    model, tokenizer = load_tiny(tiny_model_dir)
    generate = HFGenerator(model, tokenizer, max_new_tokens=6, batch_size=8)
    eos, word = generate.eos_token_ids[0], tokenizer("a", add_special_tokens=False)["input_ids"][0]
    ends = {0: 1, 1: 3, 2: 5}  # the step at which row k writes eos; before it, the token of "a"

    def force_ends(input_ids, scores):
        step = input_ids.shape[1] - 1
        scores[:] = -float("inf")
        for row, at in ends.items():
            scores[row, eos if step == at else word] = 0.0
        return scores

    real = model.generate
    model.generate = lambda **kw: real(**kw, logits_processor=[force_ends])
    progress = _Progress(generate, total=3, max_turns=2, desc="eval", enabled=True)
    seen = []
    progress.bar.set_postfix_str = seen.append
    progress([[1], [2], [3]])
    assert seen == [
        "round 1/2, 0/3 turns written",
        "round 1/2, 1/3 turns written",
        "round 1/2, 2/3 turns written",
        "round 1/2, 3/3 turns written",
    ]
    progress.close()
    assert generate.on_turns is None


def test_cli_progress_counts_the_turns_written_under_vllm(tiny_model_dir, tmp_path, cache, capsys, monkeypatch):
    """`eval --use_vllm true` on the fake engine (`tests/fake_vllm.py` as the `vllm` package): the bar counts every
    round's turns once vLLM returns them (it showed `0/N turns written` for every round)."""
    import sys
    import types

    import fake_vllm

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = fake_vllm.FakeLLM, fake_vllm.FakeSamplingParams
    vllm.inputs = types.ModuleType("vllm.inputs")
    vllm.inputs.TokensPrompt = dict  # a TypedDict in vLLM
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", vllm.inputs)
    data = tmp_path / "qa.jsonl"  # the fake engine answers Q<k> in round 1 + k % 4 (`fake_vllm.end_round`)
    data.write_text(
        "".join(json.dumps({"question": f"Q{k} where?", "golden_answers": [f"A{k}"]}) + "\n" for k in range(4))
    )
    out = tmp_path / "eval"
    argv = ["eval", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--use_vllm", "true"]
    argv += ["--dataset_name", str(data), "--corpus", str(DEMO.corpus), "--max_turns", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for shown in ("round 1/3, 4/4 turns written", "round 2/3, 3/3 turns written", "round 3/3, 2/2 turns written"):
        assert shown in err, err[-2000:]
    overall = json.loads((out / "results.json").read_text())["modes"]["memory"]["overall"]
    assert overall["em"] == 0.75  # Q0, Q1 and Q2 answer within 3 rounds, Q3 does not
