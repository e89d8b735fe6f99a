"""The trainer's wiring of every MemPO setting, through `MemPOTrainer._generate_and_score_completions`.

A scripted policy plays three questions (G = 2) and the answer scorer returns a table of per-round probabilities, so
the per-token advantages of every row are computed here by hand (docs/algorithm.md) for several settings. A second
test keeps the real scorer and checks P_full / P_mem against a plain forward of the model.
"""

import math
import re
import statistics

import pytest
import torch
from datasets import Dataset
from helpers import EchoRetriever, cpu_config, scripted_scorers

from mempo_trl import MemPOTrainer
from mempo_trl.kit.tiny import load_tiny


def turn(mem, action, content):
    return f"<mem>{mem}</mem><think>t</think><{action}>{content}</{action}>"


# question -> (gold, per trajectory the scripted turns); the <mem> text of round r of trajectory "x1" is "x1 r<r>".
SCRIPT = {
    "Where is Alpha?": (
        ["Paris"],
        [
            [turn("a1 r1", "search", "alpha"), turn("a1 r2", "answer", "Paris")],
            [turn("a2 r1", "search", "alpha"), turn("a2 r2", "search", "alpha 2"), turn("a2 r3", "answer", "Lyon")],
        ],
    ),
    "Where is Gamma?": (  # both right: outcome advantage exactly 0; one scored round: a pool of one value
        ["Oslo"],
        [
            [turn("g1 r1", "search", "gamma"), turn("g1 r2", "answer", "Oslo")],
            [turn("g2 r1", "answer", "Oslo")],
        ],
    ),
    "Where is Delta?": (  # the second answer is right by sub-EM only
        ["Bern"],
        [
            [turn("d1 r1", "search", "delta"), turn("d1 r2", "answer", "Bern")],
            [turn("d2 r1", "search", "delta"), turn("d2 r2", "answer", "city of Bern")],
        ],
    ),
}
EM = {"a1": 1.0, "a2": 0.0, "g1": 1.0, "g2": 1.0, "d1": 1.0, "d2": 0.0}
# probability of every gold token for each scored round, under the full context, the <mem> context and the reference
P_FULL = {"a1 r2": 0.35, "a2 r2": 0.68, "a2 r3": 0.55, "g1 r2": 0.8, "d1 r2": 0.6, "d2 r2": 0.45}
P_MEM = {"a1 r2": 0.12, "a2 r2": 0.71, "a2 r3": 0.9, "g1 r2": 0.7, "d1 r2": 0.52, "d2 r2": 0.75}
P_REF = {"a1 r2": 0.62, "a2 r2": 0.25, "a2 r3": 0.33, "g1 r2": 0.58, "d1 r2": 0.4, "d2 r2": 0.95}


def make_trainer(model_dir, output_dir, monkeypatch, scripted_scores=True, **config):
    model, tokenizer = load_tiny(model_dir)
    rows = [{"question": q, "golden_answers": gold} for q, (gold, _) in SCRIPT.items()]
    args = cpu_config(output_dir, per_device_train_batch_size=6, **config)
    dataset = Dataset.from_list(rows)
    trainer = MemPOTrainer(model, EchoRetriever(), args=args, train_dataset=dataset, processing_class=tokenizer)
    started = {}

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        outs = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            question = next(q for q in SCRIPT if q in text)
            turns = SCRIPT[question][1]
            seen = [(k, j) for k, script in enumerate(turns) for j, t in enumerate(script) if t in text]
            if seen:  # memory mode: the context holds the previous turn only
                ((k, j),) = seen
            else:  # round 1 of the next trajectory of this question
                k, j = started.setdefault(question, -1) + 1, -1
                started[question] = k
            outs.append(tokenizer(turns[k][j + 1], add_special_tokens=False)["input_ids"])
        return outs, None

    def probability(model, context):
        trajectory, r = re.findall(r"<mem>(\w+) r(\d)</mem>", context)[-1]
        if context.endswith("</mem>"):  # <mem> context: system + question + this round's <mem>
            return P_MEM[f"{trajectory} r{r}"]
        # full context: ends with the previous round's result
        return (P_REF if model is trainer.ref_model else P_FULL)[f"{trajectory} r{int(r) + 1}"]

    monkeypatch.setattr(trainer, "_generate_single_turn", scripted_generate)
    if scripted_scores:
        answer_token_logps, shared_prefix_answer_logps = scripted_scorers(tokenizer, probability)
        monkeypatch.setattr("mempo_trl.memory_scoring.answer_token_logps", answer_token_logps)
        monkeypatch.setattr("mempo_trl.memory_scoring.shared_prefix_answer_logps", shared_prefix_answer_logps)
    trainer.model.train()
    return trainer, tokenizer


def play(trainer):
    inputs = [{"question": q, "golden_answers": gold} for q, (gold, _) in SCRIPT.items() for _ in range(2)]
    return trainer._generate_and_score_completions(inputs)


def script_rows():
    """``(question index, trajectory label, 1-based round)`` of every row, in the trainer's order."""
    return [
        (qi, f"{q[9].lower()}{k + 1}", r + 1)
        for qi, (q, (_, turns)) in enumerate(SCRIPT.items())
        for k, script in enumerate(turns)
        for r in range(len(script))
    ]


def expected_advantages(out, tokenizer, args):
    """The per-token advantages of every row, from the tables above and the settings in ``args``."""
    rows = script_rows()
    # Outcome: EM per trajectory, GRPO-normalised within each question's pair (unbiased std + 1e-4).
    outcome = {}
    for qi in range(len(SCRIPT)):
        labels = sorted({label for q, label, _ in rows if q == qi})
        rewards = [EM[label] for label in labels]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        outcome.update({label: (EM[label] - mean) / (std + 1e-4) for label in labels})
    # The <mem> span (inclusive token indices) of every row from round 2 on.
    spans = {}
    for i, (_, label, r) in enumerate(rows):
        ids = out["completion_ids"][i].tolist()
        if r > 1:
            spans[(label, r)] = (
                ids.index(tokenizer.convert_tokens_to_ids("<mem>")),
                ids.index(tokenizer.convert_tokens_to_ids("</mem>")),
            )
    # P_full / P_mem with the confidence filter (keep tokens with log p > threshold; P = 0 when none is kept).
    full_table = P_REF if args.memory_full_from_reference else P_FULL
    p = {key: (full_table[f"{key[0]} r{key[1]}"], P_MEM[f"{key[0]} r{key[1]}"]) for key in spans}
    threshold = args.memory_threshold
    if args.memory_threshold_quantile is not None:
        assert args.memory_threshold_quantile == 0.0  # the 0-quantile is the smallest log-prob of the batch
        threshold = min(float(torch.tensor(math.log(v))) for pair in p.values() for v in pair)
    if threshold is not None:
        p = {
            key: tuple(v if float(torch.tensor(math.log(v))) > threshold else 0.0 for v in pair)
            for key, pair in p.items()
        }
    reward = {}
    for key, (pf, pm) in p.items():
        if args.memory_reward_type == "diff":
            reward[key] = pm - pf
        else:
            reward[key] = math.log(pm + args.memory_reward_eps) - math.log(pf + args.memory_reward_eps)
        length = spans[key][1] - spans[key][0] + 1
        reward[key] -= args.memory_length_penalty * length / args.max_completion_length
    # Pools: all scored rounds of a question (or of a question and round); (r - mean) / (std + 1e-6), the std of the
    # pool, of every scored round of the batch, or none.
    question_of = {label: qi for qi, label, _ in rows}
    pools = {}
    for label, r in reward:
        pool = (question_of[label], r) if args.memory_pooling == "question_round" else question_of[label]
        pools.setdefault(pool, []).append(reward[(label, r)])
    memory = {}
    for label, r in reward:
        values = pools[(question_of[label], r) if args.memory_pooling == "question_round" else question_of[label]]
        mean, std = (statistics.mean(values), statistics.stdev(values)) if len(values) > 1 else (0.0, 1.0)
        if args.memory_scale_rewards != "group":
            std = statistics.stdev(reward.values()) if args.memory_scale_rewards == "batch" else 0.0
        memory[(label, r)] = (reward[(label, r)] - mean) / (std + 1e-6) if std > 0 else reward[(label, r)] - mean
        if args.memory_gate_on_outcome and outcome[label] < 0:
            memory[(label, r)] = 0.0
    expected = torch.zeros_like(out["advantages"])
    for i, (_, label, r) in enumerate(rows):
        n = int(out["completion_mask"][i].sum())
        expected[i, :n] = outcome[label]
        if (label, r) in memory:
            start, end = spans[(label, r)]
            expected[i, start : end + 1] += args.memory_coef * memory[(label, r)]
    return expected


VARIANTS = {
    "defaults": {},
    "filter-off": {"memory_threshold": None},
    "per-round-gated-half": {
        "memory_threshold": None,
        "memory_pooling": "question_round",
        "memory_gate_on_outcome": True,
        "memory_coef": 0.5,
    },
    "batch-scaled": {"memory_scale_rewards": "batch"},
    "unscaled-per-round": {"memory_scale_rewards": "none", "memory_pooling": "question_round"},
    "quantile-log-ratio-length-reference": {
        "memory_threshold": None,
        "memory_threshold_quantile": 0.0,  # drops a1 r2's P_mem (the smallest probability of the batch)
        "memory_reward_type": "log_ratio",
        "memory_length_penalty": 0.5,
        "memory_full_from_reference": True,
        "beta": 0.04,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_advantages_follow_every_memory_setting(variant, tiny_model_dir, tmp_path, monkeypatch):
    trainer, tokenizer = make_trainer(tiny_model_dir, tmp_path, monkeypatch, **VARIANTS[variant])
    out = play(trainer)
    assert out["advantages"].shape[0] == len(script_rows())
    expected = expected_advantages(out, tokenizer, trainer.args)
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scoring", ["shared_prefix", "batched"])
def test_memory_scoring_uses_untempered_log_probs(scoring, tiny_model_dir, tmp_path, monkeypatch):
    # Sampling temperature 0.7 must not reach the scorer: P is computed from the model's untempered logits.
    trainer, _ = make_trainer(
        tiny_model_dir,
        tmp_path,
        monkeypatch,
        scripted_scores=False,
        temperature=0.7,
        memory_threshold=None,
        memory_scoring=scoring,
    )
    seen = {}
    memory_rewards = trainer._memory_rewards

    def spy(rows, dropped=()):
        seen["rows"], seen["scored"] = rows, memory_rewards(rows, dropped)
        return seen["scored"]

    monkeypatch.setattr(trainer, "_memory_rewards", spy)
    play(trainer)
    scored = [i for i, row in enumerate(seen["rows"]) if row.scoring is not None]
    assert len(scored) == 6 and (~seen["scored"].reward.isnan()).nonzero().flatten().tolist() == scored
    model = trainer.model
    for i in scored:
        pair = seen["rows"][i].scoring
        for item, key in ((pair.full, "p_full"), (pair.mem, "p_mem")):
            ids = torch.tensor([item.context_ids + item.answer_ids])
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            start = len(item.context_ids) - 1
            answer = torch.tensor(item.answer_ids)
            token_logps = logps[start : start + len(answer)].gather(-1, answer[:, None])[:, 0]
            gold = torch.tensor(item.answer_mask, dtype=torch.bool)
            expected = token_logps[gold].mean().exp().item()
            assert getattr(seen["scored"], key)[i].item() == pytest.approx(expected, rel=1e-4), (i, key)
