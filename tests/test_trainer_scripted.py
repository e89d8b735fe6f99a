"""MemPOTrainer on a scripted policy: contexts, rows, masks, <mem> spans and advantages checked by hand.

Generation is replaced by a script keyed on (question, round) and the answer scorer by a table of P values, so every
number below is computed by hand from docs/algorithm.md. It runs under the tiny tokenizer (tags are single
tokens) and Qwen2.5's real one, with a model that stops after its action and one that keeps talking.
"""

import math
import re
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import EchoRetriever, cpu_config
from transformers import Qwen2ForCausalLM

import mempo_trl
from mempo_trl import MemPOTrainer, rewards
from mempo_trl.context import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM_PROMPT
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.loading import load_tokenizer
from mempo_trl.settings import DynamicSamplingSettings


def turn(mem, action, content):
    return f"<mem>{mem}</mem><think>t</think><{action}>{content}</{action}>"


# question -> per trajectory (G = 2) the scripted turns
SCRIPT = {
    "Where is Alpha?": [
        [turn("a1 one", "search", "alpha"), turn("a1 two", "answer", "Paris")],
        [turn("a2 one", "search", "alpha"), turn("a2 two", "search", "alpha 2"), turn("a2 three", "answer", "Lyon")],
    ],
    "Where is Beta?": [
        ["<think>no memory</think><search>beta</search>"],  # invalid: ends the episode, outcome 0
        [turn("b2 one", "search", "beta"), turn("b2 two", "answer", "Rome")],
    ],
}
GOLDS = {"Where is Alpha?": ["Paris"], "Where is Beta?": ["Rome"]}
# (P_full, P_mem) for every scored round, keyed by the round's <mem> text
P_VALUES = {"a1 two": (0.35, 0.12), "a2 two": (0.68, 0.71), "a2 three": (0.5, 0.5), "b2 two": (0.2, 0.6)}
PREVIOUS_MEM = {"a1 one": "a1 two", "a2 one": "a2 two", "a2 two": "a2 three", "b2 one": "b2 two"}


# After its action the scripted model keeps talking (a hallucinated result); under Qwen2.5 the tag's `>` merges with
# the `<` that follows into one token `><`.
CHATTER = "<information>Doc 1(Title: invented) more</information>"


def kept_ids(tokenizer, turn, chatter):
    """Brute force: the shortest prefix of the sampled ids whose text holds the whole turn."""
    ids = tokenizer(turn + chatter, add_special_tokens=False)["input_ids"]
    return next(ids[:k] for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).startswith(turn))


@pytest.fixture(params=[("tiny", ""), ("tiny", CHATTER), ("qwen2.5", ""), ("qwen2.5", CHATTER)], ids="-".join)
def scripted_trainer(request, tiny_model_dir, tmp_path, monkeypatch):
    name, chatter = request.param
    if name == "tiny":
        model, tokenizer = load_tiny(tiny_model_dir)
    else:
        model_dir = request.getfixturevalue("qwen_model_dir")
        model, tokenizer = Qwen2ForCausalLM.from_pretrained(model_dir), load_tokenizer(model_dir)
    dataset = Dataset.from_list([{"question": q, "golden_answers": GOLDS[q], "data_source": "demo"} for q in SCRIPT])
    args = cpu_config(tmp_path, memory_threshold=None)
    retriever = EchoRetriever()
    trainer = MemPOTrainer(model, retriever, args=args, train_dataset=dataset, processing_class=tokenizer)

    counters = {}

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        outs = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            question = next(q for q in SCRIPT if q in text)
            seen = [(k, j) for k, turns in enumerate(SCRIPT[question]) for j, t in enumerate(turns) if t in text]
            if seen:  # memory mode: the context holds the previous turn only
                ((k, j),) = seen
                outs.append(tokenizer(SCRIPT[question][k][j + 1] + chatter, add_special_tokens=False)["input_ids"])
            else:  # round 1 of the next trajectory of this question
                counters[question] = counters.get(question, -1) + 1
                text = SCRIPT[question][counters[question]][0]
                outs.append(tokenizer(text + chatter, add_special_tokens=False)["input_ids"])
        return outs, None

    def scripted_logps(model, items, pad_token_id, batch_size=8, num_chunks=None):
        k = max((len(it.answer_ids) for it in items), default=0)
        logps = torch.zeros(len(items), k)
        mask = torch.zeros(len(items), k, dtype=torch.bool)
        for i, it in enumerate(items):
            text = tokenizer.decode(it.context_ids, skip_special_tokens=False)
            last_mem = re.findall(r"<mem>(.*?)</mem>", text)[-1]
            if text.endswith("</mem>"):  # mem context: system + question + this round's <mem>
                p = P_VALUES[last_mem][1]
            else:  # full context: ends with the previous round's result
                p = P_VALUES[PREVIOUS_MEM[last_mem]][0]
            n = sum(it.answer_mask)
            logps[i, :n] = math.log(p)
            mask[i, :n] = True
        return logps, mask

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted_generate)
    monkeypatch.setattr("mempo_trl.memory_scoring.answer_token_logps", scripted_logps)
    monkeypatch.setattr(
        "mempo_trl.memory_scoring.shared_prefix_answer_logps",
        lambda model, items, group_keys, pad_token_id, batch_size=8, num_chunks=None: scripted_logps(
            model, items, pad_token_id, batch_size, num_chunks
        ),
    )
    return trainer, tokenizer, retriever, chatter


def test_scripted_rollout_rows_contexts_and_advantages(scripted_trainer):
    trainer, tokenizer, retriever, chatter = scripted_trainer
    trainer.model.train()
    inputs = [{"question": q, "golden_answers": GOLDS[q], "data_source": "demo"} for q in SCRIPT for _ in range(2)]
    out = trainer._generate_and_score_completions(inputs)

    # Rows: A1 2 rounds, A2 3 rounds, B1 1 round, B2 2 rounds = 8 real rows (steps_per_generation = 1: no padding).
    assert out["completion_ids"].shape[0] == 8
    expected_rows = [("Where is Alpha?", 0, r) for r in range(2)] + [("Where is Alpha?", 1, r) for r in range(3)]
    expected_rows += [("Where is Beta?", 0, 0)] + [("Where is Beta?", 1, r) for r in range(2)]
    pad = tokenizer.pad_token_id
    for i, (q, k, r) in enumerate(expected_rows):
        # The completion is the scripted turn as sampled, up to the token completing its action tag.
        turn_ids = kept_ids(tokenizer, SCRIPT[q][k][r], chatter)
        n = int(out["completion_mask"][i].sum())
        assert out["completion_ids"][i, :n].tolist() == turn_ids
        # The prompt is rebuilt from the question, the previous turn and its result only, spelled out here in
        # ChatML (both tokenizers' template) rather than with the context builder under test.
        expected_text = (
            f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
            f"<|im_start|>user\n{DEFAULT_INSTRUCTION.format(question=q)}<|im_end|>\n"
        )
        if r > 0:
            query = re.findall(r"<search>(.*?)</search>", SCRIPT[q][k][r - 1])[0]
            expected_text += (
                f"<|im_start|>assistant\n{SCRIPT[q][k][r - 1]}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                f"<information>Doc 1(Title: T {query}) about {query}</information>\n</tool_response><|im_end|>\n"
            )
        expected_text += "<|im_start|>assistant\n"
        prompt = [t for t, m in zip(out["prompt_ids"][i].tolist(), out["prompt_mask"][i].tolist()) if m]
        assert tokenizer.decode(prompt) == expected_text, (q, k, r)
        assert prompt == tokenizer(expected_text, add_special_tokens=False)["input_ids"], (q, k, r)
        assert pad not in prompt
    # One batched retriever call per round, with the queries of the searching episodes.
    assert retriever.calls == [["alpha", "alpha", "beta"], ["alpha 2"]]

    # Outcome: groups [1, 0] and [0, 1]; TRL: (r - mean) / (std + 1e-4) with the unbiased std.
    a = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-4)
    outcome = {
        ("Where is Alpha?", 0): a,
        ("Where is Alpha?", 1): -a,
        ("Where is Beta?", 0): -a,
        ("Where is Beta?", 1): a,
    }
    # Memory: pool A = rewards of a1 two, a2 two, a2 three; pool B has one value (mean 0, std 1).
    rewards = {m: pm - pf for m, (pf, pm) in P_VALUES.items()}
    assert rewards["a1 two"] == pytest.approx(-0.23) and rewards["a2 two"] == pytest.approx(0.03)
    pool = [rewards["a1 two"], rewards["a2 two"], rewards["a2 three"]]
    mean, std = statistics.mean(pool), statistics.stdev(pool)
    mem_adv = {m: (rewards[m] - mean) / (std + 1e-6) for m in ("a1 two", "a2 two", "a2 three")}
    mem_adv["b2 two"] = rewards["b2 two"]

    adv = out["advantages"]
    assert adv.shape == out["completion_ids"].shape
    for i, (q, k, r) in enumerate(expected_rows):
        ids = out["completion_ids"][i].tolist()
        n = int(out["completion_mask"][i].sum())
        expected = torch.full((adv.shape[1],), outcome[(q, k)])
        expected[n:] = 0.0
        mem = re.match(r"<mem>(.*?)</mem>", SCRIPT[q][k][r])
        if r > 0:  # the turn starts with <mem>: its span runs from token 0 to the token completing </mem>
            start = 0
            end = next(e for e in range(n) if mem.group(0) in tokenizer.decode(ids[: e + 1]))
            assert tokenizer.decode(ids[start : end + 1]).startswith(mem.group(0))
            expected[start : end + 1] += mem_adv[mem.group(1)]
        torch.testing.assert_close(adv[i], expected, rtol=1e-5, atol=1e-5)

    assert int(out["num_items_in_batch"]) == int(out["completion_mask"].sum())
    metrics = trainer._metrics["train"]
    assert metrics["episode/em"][-1] == pytest.approx(0.5)
    assert metrics["episode/format_valid"][-1] == pytest.approx(0.75)
    assert metrics["episode/turns"][-1] == pytest.approx(8 / 4)
    assert metrics["memory/reward"][-1] == pytest.approx(statistics.mean(rewards.values()))


def test_an_invalid_episode_still_scores_the_memories_it_wrote(scripted_trainer, monkeypatch):
    """The memory reward asks whether a `<mem>` keeps what the history had; an episode that later breaks the
    protocol (outcome 0) still wrote rounds 2 and 3's memories, and both are scored (docs/algorithm.md, "Memory
    reward")."""
    trainer, _, _, _ = scripted_trainer
    question = "Where is Gamma?"
    monkeypatch.setitem(GOLDS, question, ["Oslo"])
    monkeypatch.setitem(
        SCRIPT,
        question,
        [
            [turn("g1 one", "search", "gamma"), turn("g1 two", "search", "gamma 2"), "<mem>g1 three</mem> stray"],
            [turn("g2 one", "search", "gamma"), turn("g2 two", "answer", "Oslo")],
        ],
    )
    for mem, p in {"g1 two": (0.3, 0.4), "g1 three": (0.3, 0.2), "g2 two": (0.5, 0.5)}.items():
        monkeypatch.setitem(P_VALUES, mem, p)
    for mem, nxt in {"g1 one": "g1 two", "g1 two": "g1 three", "g2 one": "g2 two"}.items():
        monkeypatch.setitem(PREVIOUS_MEM, mem, nxt)
    trainer.model.train()
    trainer._generate_and_score_completions(
        [{"question": question, "golden_answers": ["Oslo"], "data_source": "demo"}] * 2
    )
    metrics = trainer._metrics["train"]
    assert metrics["episode/format_valid"][-1] == pytest.approx(0.5)
    assert metrics["memory/scored_rounds"][-1] == 3  # g1 two, g1 three (in the invalid episode) and g2 two
    rewards = [0.4 - 0.3, 0.2 - 0.3, 0.5 - 0.5]
    assert metrics["memory/reward"][-1] == pytest.approx(statistics.mean(rewards))


def test_invalid_first_turn_ends_episode_with_zero_outcome(scripted_trainer):
    trainer, _, _, _ = scripted_trainer
    trainer.model.train()
    inputs = [{"question": "Where is Beta?", "golden_answers": ["Rome"], "data_source": "demo"}] * 2
    out = trainer._generate_and_score_completions(inputs)
    assert out["completion_ids"].shape[0] == 3  # B1: 1 round, B2: 2 rounds
    assert trainer._metrics["train"]["episode/format_valid"][-1] == pytest.approx(0.5)


def test_zero3_gathers_the_parameters_once_per_rollout(scripted_trainer, monkeypatch):
    """Under ZeRO-3, TRL gathers all parameters around every `generate` (every round here): the rollout gathers once
    (`unwrap_model_for_generation`) and turns the rounds' own gather off until it ends."""
    trainer, *_ = scripted_trainer
    entered, round_flags = [], []

    @contextmanager
    def counting_unwrap(model, accelerator, **kwargs):
        entered.append(trainer.args.ds3_gather_for_generation)
        yield accelerator.unwrap_model(model)

    generate = trainer._generate_single_turn

    def recording_generate(*args, **kwargs):
        round_flags.append(trainer.args.ds3_gather_for_generation)
        return generate(*args, **kwargs)

    monkeypatch.setattr("mempo_trl.grpo_mirror.unwrap_model_for_generation", counting_unwrap)
    monkeypatch.setattr(trainer, "_generate_single_turn", recording_generate)
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)  # as under accelerate's DeepSpeed plugin
    inputs = [{"question": q, "golden_answers": GOLDS[q], "data_source": "demo"} for q in SCRIPT for _ in range(2)]
    episodes = trainer._play_episodes(inputs).episodes
    assert max(len(ep.rounds) for ep in episodes) == len(round_flags) == 3
    assert entered == [True]  # one gather for the three rounds
    assert round_flags == [False, False, False]  # TRL's per-round gather skipped
    assert trainer.args.ds3_gather_for_generation is True  # restored


def test_a_process_with_nothing_to_score_still_issues_the_shared_prefix_forwards(scripted_trainer, monkeypatch):
    """Under ZeRO-3 every forward is collective: a process whose episodes have no scored round must run the same
    scorer (and number of chunks) as the others, not fall back to the batched one."""
    trainer, *_ = scripted_trainer
    calls = []
    monkeypatch.setattr(trainer, "shared_prefix_scoring", True)
    monkeypatch.setattr(trainer, "_global_max", lambda value: max(value, 2))  # another process needs 2 chunks
    monkeypatch.setattr(
        "mempo_trl.memory_scoring.shared_prefix_answer_logps",
        lambda model, items, keys, pad, bs, num_chunks: (
            calls.append((len(items), keys, num_chunks)) or (torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool))
        ),
    )
    monkeypatch.setattr(
        "mempo_trl.memory_scoring.answer_token_logps", lambda *a, **k: pytest.fail("batched scorer used")
    )
    assert [column.numel() for column in trainer._memory_rewards(())] == [0, 0, 0]
    assert calls == [(0, [], 2), (0, [], 2)]  # the full contexts, then the mem contexts


def test_episode_metrics_come_from_one_outcome_score_per_episode(scripted_trainer, monkeypatch):
    """The ``episode/*`` metrics, hand-computed, and the outcome reward read the same score: `outcome_score` runs
    once per episode in a step (the reward function takes the trainer's ``outcome`` column)."""
    trainer, _, _, _ = scripted_trainer
    question = "Where is Delta?"
    monkeypatch.setitem(GOLDS, question, ["Paris"])
    monkeypatch.setitem(
        SCRIPT,
        question,
        [
            [turn("d1 one", "search", "delta"), turn("d1 two", "answer", "Paris France")],
            [turn("d2 one", "answer", "the paris")],
        ],
    )
    monkeypatch.setitem(P_VALUES, "d1 two", (0.5, 0.25))
    monkeypatch.setitem(PREVIOUS_MEM, "d1 one", "d1 two")
    calls = []
    scorer = rewards.outcome_score
    monkeypatch.setattr(rewards, "outcome_score", lambda *a, **k: calls.append(a) or scorer(*a, **k))
    trainer.model.train()
    trainer._generate_and_score_completions(
        [{"question": question, "golden_answers": ["Paris"], "data_source": "demo"}] * 2
    )
    assert len(calls) == 2
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
    # d1: "Paris France" vs "Paris": EM 0, token F1 2 * (1/2 * 1) / (1/2 + 1) = 2/3, sub-EM 1; d2: "the paris" EM 1.
    expected = {"em": 0.5, "f1": (2 / 3 + 1) / 2, "sub_em": 1.0, "format_valid": 1.0, "answer_rate": 1.0}
    expected |= {"turns": 1.5, "searches": 0.5, "context_overflow": 0.0}
    assert {k: v for k, v in metrics.items() if k.startswith("episode/") and k != "episode/truncated_turns"} == (
        pytest.approx({f"episode/{name}": value for name, value in expected.items()})
    )
    assert metrics["rewards/mempo_outcome_reward/mean"] == pytest.approx(0.5)


def step_walk(trainer, inputs) -> list[str]:
    """The `mempo_trl` modules that `_generate_and_score_completions` hands the step's data to, in call order:
    every call into another `mempo_trl` module made by the trainer itself (or by TRL code it called), not the calls
    those modules make in turn; consecutive calls into one module count once. `grpo_mirror` is part of the trainer
    (the class it mixes in: TRL's internals the trainer mirrors)."""
    package = Path(mempo_trl.__file__).parent
    trainer_files = {str(package / "trainer.py"), str(package / "grpo_mirror.py")}
    walk = []

    def module_of(filename):
        path = Path(filename)
        return ".".join(path.relative_to(package).with_suffix("").parts) if path.is_relative_to(package) else None

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module_of(frame.f_code.co_filename)
        if callee in (None, "trainer", "grpo_mirror"):
            return
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_filename in trainer_files:
                if caller.f_code.co_name == "_generate_and_score_completions":
                    if not walk or walk[-1] != callee:
                        walk.append(callee)
                    return
            elif module_of(caller.f_code.co_filename) is not None:
                return  # a call made inside another stage
            caller = caller.f_back

    sys.setprofile(profile)
    try:
        trainer._generate_and_score_completions(inputs)
    finally:
        sys.setprofile(None)
    return walk


@pytest.mark.parametrize("dynamic_sampling", ["keep", "drop"])
def test_a_steps_data_visits_each_module_once_downwards(scripted_trainer, dynamic_sampling):
    """The walk of a step's data: the rollout (with its training rows), the outcome scores and rewards, dynamic
    sampling, the padded round batch, memory scoring, the memory reward, the advantages, the finite check and MemPO's metrics, each entered
    once, in that order (docs/algorithm.md, "Module map"); TRL's log-probs and loss follow in the trainer."""
    trainer, _, _, _ = scripted_trainer
    trainer.dynamic_sampling_settings = DynamicSamplingSettings(dynamic_sampling)
    trainer.model.train()
    inputs = [{"question": q, "golden_answers": GOLDS[q], "data_source": "demo"} for q in SCRIPT for _ in range(2)]
    walk = step_walk(trainer, inputs)
    order = ["rollout", "rewards", "dynamic_sampling", "padding", "memory_scoring", "advantages"]
    order += ["interruptions", "metrics"]
    expected = [m for m in order if m != "dynamic_sampling" or dynamic_sampling != "keep"]
    assert walk == expected, walk


def test_the_trainer_scores_the_weakest_part_of_a_multi_part_gold(scripted_trainer, monkeypatch):
    """``memory_reward_parts="weakest"`` and ``"losses"`` through the trainer's memory scoring: the scorer's
    answer-token log-probs (full history 0.9 / 0.8, memory 0.9 / 0.2 on parts 1 / 2) give the reward of part 2,
    0.2 - 0.8, and the mean of the parts' losses, (0 - 0.6) / 2; "joint" gives the geometric means' difference."""
    from dataclasses import replace
    from types import SimpleNamespace

    from mempo_trl.context import MemoryScoringPair, ScoringItem

    trainer, *_ = scripted_trainer
    parts = (0, 1, 1, 2, 0)
    item = ScoringItem([1, 2], [5, 6, 7, 8, 9], [0, 1, 1, 1, 0])
    pair = MemoryScoringPair(1, item, ScoringItem([1, 3], item.answer_ids, item.answer_mask), answer_parts=parts)
    rows = [SimpleNamespace(episode_index=0, round_index=1, scoring=pair, mem_span=(0, 3))]
    probabilities = {(1, 2): [1.0, 0.9, 0.9, 0.8, 1.0], (1, 3): [1.0, 0.9, 0.9, 0.2, 1.0]}

    def score_items(items, use_reference, group_keys=None):
        logps = torch.log(torch.tensor([probabilities[tuple(it.context_ids)] for it in items]))
        return logps, torch.tensor([it.answer_mask for it in items], dtype=torch.bool)

    monkeypatch.setattr(trainer, "_score_items", score_items)
    monkeypatch.setattr(trainer, "_score_memory", True)
    settings = replace(trainer.memory_settings, memory_threshold=None, memory_length_penalty=0.0)
    monkeypatch.setattr(trainer, "memory_settings", replace(settings, memory_reward_parts="weakest"))
    assert trainer._memory_rewards(rows).reward.tolist() == pytest.approx([0.2 - 0.8], abs=1e-6)
    monkeypatch.setattr(trainer, "memory_settings", replace(settings, memory_reward_parts="losses"))
    assert trainer._memory_rewards(rows).reward.tolist() == pytest.approx([(0 - 0.6) / 2], abs=1e-6)
    monkeypatch.setattr(trainer, "memory_settings", settings)
    joint = (0.9 * 0.9 * 0.2) ** (1 / 3) - (0.9 * 0.9 * 0.8) ** (1 / 3)
    assert trainer._memory_rewards(rows).reward.tolist() == pytest.approx([joint], abs=1e-6)
