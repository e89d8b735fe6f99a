"""SFT warm start: the oracle agent, the SFT contexts (equal to the rollout's) and the warm-started tiny model."""

import doctest
import json
import random

import pytest
import torch

from mempo_trl.context import DEFAULT_INSTRUCTION, render_information, render_prompt
from mempo_trl.data import read_jsonl
from mempo_trl.kit import warmstart
from mempo_trl.kit.learner import LEARNER_INSTRUCTION
from mempo_trl.kit.warmstart import (
    WARM_START_FILE,
    build_warm_tiny_model,
    hop_facts,
    oracle_episode_turns,
    sft_examples,
    sft_warm_start,
    tiny_warm_settings,
)
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rewards import exact_match
from mempo_trl.rollout import RolloutEngine
from mempo_trl.turns import parse_turn


@pytest.fixture(scope="module")
def retriever(demo_paths, tmp_path_factory):
    from mempo_trl.retrieval import BM25Retriever

    return BM25Retriever.from_corpus(str(demo_paths.corpus), cache_dir=tmp_path_factory.mktemp("bm25"))


@pytest.fixture(scope="module")
def all_rows(demo_paths):
    return read_jsonl(demo_paths.train) + read_jsonl(demo_paths.test)


@pytest.fixture(scope="module")
def one_row_per_kind(all_rows):
    return list({row["data_source"]: row for row in all_rows}.values())


def test_doctests():
    assert doctest.testmod(warmstart).failed == 0


def test_repair_searches_each_dropped_fact_again_and_answers_what_the_memory_holds(all_rows, retriever):
    """With ``repair``, every fact the memory dropped is searched again after the hops, the memory grows by it, and
    the answer turn's memory holds every fact; drops that would not fit ``max_turns`` are not made."""
    row = max(all_rows, key=lambda r: len(r["hop_queries"]))
    queries, facts = row["hop_queries"], hop_facts(row, retriever.search(row["hop_queries"], 3))
    for seed in range(20):
        plain = oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(seed))
        turns = oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(seed), repair=True)
        parsed = [parse_turn(text) for text, _ in turns]
        assert all(t.valid for t in parsed) and parsed[-1].action == "answer"
        assert parsed[-1].mem == " ".join(facts)  # every fact, in hop order
        dropped = [f for f in facts if f not in parse_turn(plain[-1][0]).mem]
        repairs = parsed[len(queries) : -1]
        assert [t.content for t in repairs] == [queries[facts.index(f)] for f in dropped]
        assert [t.content for t in parsed[: len(queries)]] == queries and turns[: len(queries)] == plain[:-1]
    short = oracle_episode_turns(row, retriever, max_turns=len(queries) + 1, mem_drop=1.0, repair=True)
    assert len(short) == len(queries) + 1 and parse_turn(short[-1][0]).mem == " ".join(facts)  # no room: no drop


def test_counted_thoughts_say_how_many_hops_were_searched_and_nothing_else_changes(all_rows, retriever):
    """With ``counted``, the n-th turn's thought starts ``Searched n-1 of K.`` (the answer turn's ``Searched K of
    K.``); memories, actions, results and drops are those of the plain turns; with ``repair`` it is refused."""
    for row in {len(r["hop_queries"]): r for r in all_rows}.values():
        hops = len(row["hop_queries"])
        plain = oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(3))
        counted = oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(3), counted=True)
        assert len(counted) == len(plain) == hops + 1
        for n, ((text, information), (plain_text, plain_information)) in enumerate(zip(counted, plain)):
            turn, plain_turn = parse_turn(text), parse_turn(plain_text)
            assert turn.valid and information == plain_information
            assert (turn.mem, turn.action, turn.content) == (plain_turn.mem, plain_turn.action, plain_turn.content)
            assert turn.think == f"Searched {n} of {hops}. {plain_turn.think}"
    with pytest.raises(ValueError, match="pick one"):
        oracle_episode_turns(all_rows[0], retriever, counted=True, repair=True)


def test_oracle_turns_are_valid_and_search_the_gold_passages(all_rows, retriever, demo_paths):
    from mempo_trl.retrieval import load_corpus

    passages = {p.id: p for p in load_corpus(str(demo_paths.corpus))}
    for row in all_rows:
        turns = oracle_episode_turns(row, retriever)
        assert len(turns) == len(row["hop_queries"]) + 1
        parsed = [parse_turn(text) for text, _ in turns]
        assert all(turn.valid for turn in parsed), [t.reason for t in parsed]
        results = retriever.search(row["hop_queries"], 3)
        for turn, (_, information), query, gold_id, found in zip(
            parsed, turns, row["hop_queries"], row["supporting_ids"], results
        ):
            assert (turn.action, turn.content) == ("search", query)
            assert gold_id in [p.id for p in found]
            assert information == render_information(found)
        answer, information = parsed[-1], turns[-1][1]
        assert answer.action == "answer" and information is None
        assert exact_match(answer.content, row["golden_answers"]) == 1.0
        # Every remembered value is stated by the passage of its hop, and the final memory holds them all.
        facts = hop_facts(row, results)
        for fact, gold_id in zip(facts, row["supporting_ids"]):
            value = fact.split(": ", 1)[1].removesuffix(".")
            assert value and value in passages[gold_id].text, (fact, passages[gold_id].text)
        assert answer.mem == " ".join(facts)
        assert parsed[0].mem == "Nothing yet."


def test_oracle_rejects_rows_longer_than_max_turns(all_rows, retriever):
    row = next(row for row in all_rows if len(row["hop_queries"]) == 2)
    assert len(oracle_episode_turns(row, retriever, max_turns=3)) == 3
    with pytest.raises(ValueError, match="max_turns=2"):
        oracle_episode_turns(row, retriever, max_turns=2)


@pytest.mark.parametrize(
    ("context_mode", "instruction"),
    [("memory", DEFAULT_INSTRUCTION), ("full_history", DEFAULT_INSTRUCTION), ("memory", LEARNER_INSTRUCTION)],
)
def test_sft_examples_equal_the_rollout_contexts(
    tiny_model_dir, one_row_per_kind, retriever, context_mode, instruction
):
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    protocol = TurnProtocol(max_turns=8, context_mode=context_mode, instruction=instruction)
    engine = RolloutEngine(tokenizer, protocol, retriever, eos_token_ids=protocol.stop_token_ids(tokenizer))
    for row in one_row_per_kind:
        examples = sft_examples([row], retriever, tokenizer, context_mode=context_mode, instruction=instruction)
        completions = iter(completion for _, completion in examples)
        episodes = engine.play([row], lambda prompts, scripted=completions: ([next(scripted)], None)).episodes
        rounds = episodes[0].rounds
        assert [r.prompt_ids for r in rounds] == [prompt for prompt, _ in examples]
        # The rollout cuts the eos after the action tag: RL rows hold the turn tokens only.
        assert [r.completion_ids + [tokenizer.eos_token_id] for r in rounds] == [c for _, c in examples]
        assert [r.text for r in rounds] == [text for text, _ in oracle_episode_turns(row, retriever)]
        assert episodes[0].format_valid and exact_match(episodes[0].answer, row["golden_answers"]) == 1.0


_DEFAULTS = {"mem_drop": 0.0, "max_warm_rows": None, "instruction": DEFAULT_INSTRUCTION}


def _tiny_state(path):
    from mempo_trl.kit.tiny import load_tiny

    return load_tiny(path)[0].state_dict()


def test_sft_warm_start_is_deterministic(tmp_path, demo_paths, retriever):
    from mempo_trl.kit.tiny import build_tiny_model

    rows = read_jsonl(demo_paths.train)[:8]
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        path = build_tiny_model(tmp_path / name, seed=0)
        settings = tiny_warm_settings(steps=4, batch_size=4, seed=seed)
        runs[name] = (sft_warm_start(path, rows, retriever, settings), _tiny_state(path))
    (stats_a, state_a), (stats_b, state_b), (stats_c, _) = runs["a"], runs["b"], runs["c"]
    assert stats_a["final_loss"] == stats_b["final_loss"] != stats_c["final_loss"]
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    record = json.loads((tmp_path / "a" / WARM_START_FILE).read_text())
    assert record["settings"] == {**_DEFAULTS, "seed": 0, "steps": 4, "lr": 5e-3, "batch_size": 4}
    assert stats_a["examples"] == sum(len(row["hop_queries"]) + 1 for row in rows)


def test_prompt_loss_trains_on_the_whole_context(warm_model_dir, tmp_path, demo_paths, retriever):
    """``prompt_loss`` puts the loss on every token: the first logged loss is the model's mean next-token NLL over
    prompts and completions, computed here by hand (on the warm tiny model, which predicts its completions far better
    than the prompts, so the two losses differ by a lot)."""
    import shutil

    from mempo_trl.kit.tiny import load_tiny

    rows = read_jsonl(demo_paths.train)[:4]
    settings = tiny_warm_settings(steps=1, batch_size=64, seed=0)
    losses = {}
    for prompt_loss in (False, True):
        path = shutil.copytree(warm_model_dir, tmp_path / str(prompt_loss))
        model, tokenizer = load_tiny(path)
        data = warmstart.sft_dataset(warmstart.sft_examples(rows, retriever, tokenizer), prompt_loss)
        counts = [sum(x != -100 for x in labels[1:]) for labels in data["labels"]]  # next-token targets
        with torch.no_grad():
            nll = [
                model(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item() * n
                for ids, labels, n in zip(data["input_ids"], data["labels"], counts)
            ]
        losses[prompt_loss] = sft_warm_start(path, rows, retriever, settings, prompt_loss=prompt_loss)["initial_loss"]
        assert losses[prompt_loss] == pytest.approx(sum(nll) / sum(counts), rel=1e-3)
    assert losses[True] > 2 * losses[False]


def _batch(tokenizer, examples):
    """A right-padded batch of ``(prompt, completion)`` pairs as SFTTrainer's collator makes it."""
    from mempo_trl.padding import pad_ids

    input_ids, attention_mask = pad_ids([p + c for p, c in examples], tokenizer.pad_token_id, side="right")
    labels, _ = pad_ids([[-100] * len(p) + c for p, c in examples], -100, side="right")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def test_completion_sft_loss_is_the_cross_entropy_of_the_completions(tiny_model_dir, tmp_path, demo_paths, retriever):
    """`CompletionSFTTrainer.compute_loss` equals a hand-computed cross-entropy over the completion tokens and
    TRL's own fused LM-head loss (`add_fused_lm_head`, what `SFTTrainer` computes) on the same batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig
    from trl.trainer.utils import add_fused_lm_head

    from mempo_trl.kit.sft import CompletionSFTTrainer
    from mempo_trl.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    examples = sft_examples(read_jsonl(demo_paths.train)[:2], retriever, tokenizer)[:3]
    batch = _batch(tokenizer, examples)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_length=None, bf16=False)
    dataset = Dataset.from_dict({"input_ids": [p + c for p, c in examples]})
    trainer = CompletionSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    model.train()
    loss = trainer.compute_loss(model, dict(batch))

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    by_hand = [
        -logits[i, len(p) + j - 1].log_softmax(-1)[token]
        for i, (p, c) in enumerate(examples)
        for j, token in enumerate(c)
    ]
    assert loss.item() == pytest.approx(torch.stack(by_hand).mean().item(), abs=1e-5)
    num_items = sum(len(c) for _, c in examples) + 5
    summed = trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items)
    assert summed.item() == pytest.approx(torch.stack(by_hand).sum().item() / num_items, abs=1e-5)

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # what SFTTrainer computes
    fused = model(**batch, fused_lm_head=True, use_cache=False)
    assert loss.item() == pytest.approx((-fused.log_probs.sum() / fused.label_mask.sum()).item(), abs=1e-5)
    metrics = trainer._metrics["train"]
    assert metrics["entropy"][0] == pytest.approx((fused.entropy.sum() / fused.label_mask.sum()).item(), abs=1e-4)
    assert metrics["mean_token_accuracy"][0] == pytest.approx((fused.is_top1.sum() / fused.label_mask.sum()).item())
    assert metrics["num_tokens"] == [2 * int(batch["attention_mask"].sum())]


def test_completion_sft_trainer_refuses_what_it_does_not_compute(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from mempo_trl.kit.sft import CompletionSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="dft", max_length=None)
    with pytest.raises(ValueError, match='does not support loss_type="dft"'):
        CompletionSFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2]]}))


def test_warm_start_cli(tiny_model_dir, tmp_path, capsys):
    import shutil

    from mempo_trl.cli import main

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = _tiny_state(model)
    assert (
        main(
            [
                "kit",
                "warm-start",
                "--model_name_or_path",
                str(model),
                "--max_steps",
                "2",
                "--per_device_train_batch_size",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out  # SFTTrainer's log lines, then the stats
    assert json.loads(out[out.rindex("{\n") :])["steps"] == 2
    after = _tiny_state(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_warm_model_learned_the_format(warm_model_dir, demo_paths, retriever):
    from mempo_trl.generation import HFGenerator
    from mempo_trl.kit.tiny import load_tiny

    stats = json.loads((warm_model_dir / WARM_START_FILE).read_text())["stats"]
    assert stats["final_loss"] < stats["initial_loss"] / 5
    model, tokenizer = load_tiny(warm_model_dir)
    engine = RolloutEngine(tokenizer, TurnProtocol(), retriever)
    rows = read_jsonl(demo_paths.train)[:6]
    prompts = [render_prompt(tokenizer, engine.context_messages(episode)) for episode in engine.new_episodes(rows)]
    completions, _ = HFGenerator(model, tokenizer, max_new_tokens=48)(prompts)
    turns = [parse_turn(tokenizer.decode(ids, skip_special_tokens=True)) for ids in completions]
    assert all(turn.valid and turn.action == "search" for turn in turns), [t.reason for t in turns]


@pytest.mark.slow
def test_warm_tiny_model_is_reused(warm_model_dir):
    weights = warm_model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_warm_tiny_model(warm_model_dir, seed=0) == warm_model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_mem_drop_leaves_facts_out_of_the_memory_but_not_the_answer(one_row_per_kind, retriever):
    row = next(row for row in one_row_per_kind if row["data_source"] == "demo_compare")
    facts = hop_facts(row, retriever.search(row["hop_queries"], 3))
    kept = [parse_turn(text) for text, _ in oracle_episode_turns(row, retriever, mem_drop=0.0)]
    dropped = [parse_turn(text) for text, _ in oracle_episode_turns(row, retriever, mem_drop=1.0)]
    assert kept[-1].mem == " ".join(facts) and all(turn.mem == "Nothing yet." for turn in dropped)
    assert [(t.action, t.content) for t in dropped] == [(t.action, t.content) for t in kept]
    # About p of the facts are dropped, the same ones for the same seed.
    rng_turns = [oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(s))[-1][0] for s in range(200)]
    share = sum(fact not in text for text in rng_turns for fact in facts) / (200 * len(facts))
    assert 0.4 < share < 0.6
    assert oracle_episode_turns(row, retriever, mem_drop=0.5, rng=random.Random(3)) == oracle_episode_turns(
        row, retriever, mem_drop=0.5, rng=random.Random(3)
    )
    with pytest.raises(ValueError, match="mem_drop"):
        oracle_episode_turns(row, retriever, mem_drop=1.5)


def test_a_stopped_sft_warm_start_resumes_from_its_newest_checkpoint(tiny_model_dir, tmp_path, demo_paths, retriever):
    """`sft_warm_start(checkpoint_every=N)` keeps a checkpoint under `<model_dir>/sft`; a rerun (here: asked for more
    steps, as after a stop) continues from it instead of starting over."""
    import shutil

    from trl import SFTTrainer

    from mempo_trl.kit.warmstart import WarmSettings, sft_warm_start

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    rows = read_jsonl(demo_paths.train)[:8]
    resumed_from = []
    train = SFTTrainer.train

    def recording_train(self, *args, resume_from_checkpoint=None, **kwargs):
        resumed_from.append(resume_from_checkpoint)
        return train(self, *args, resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    SFTTrainer.train = recording_train
    try:
        settings = WarmSettings(steps=2, batch_size=2, lr=1e-3, seed=0, mem_drop=0.0)
        sft_warm_start(model_dir, rows, retriever, settings, checkpoint_every=2)
        assert (model_dir / "sft" / "checkpoint-2" / "optimizer.pt").is_file()
        stats = sft_warm_start(
            model_dir, rows, retriever, WarmSettings(**{**settings.__dict__, "steps": 3}), checkpoint_every=2
        )
    finally:
        SFTTrainer.train = train
    assert resumed_from == [None, str(model_dir / "sft" / "checkpoint-2")]
    assert stats["steps"] == 3 and json.loads((model_dir / "warm_start.json").read_text())["stats"]["steps"] == 3
