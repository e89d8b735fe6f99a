"""Gold-answer scoring under the full-history and memory contexts (docs/algorithm.md, "Memory reward"): items and masks under the tiny
and the real Qwen2.5 tokenizer, log-probs on the tiny model."""

import copy
import warnings

import pytest
import torch
from helpers import EchoRetriever

from mempo_trl.context import ScoringItem, gold_answer_parts, gold_answer_tokens, render_prompt, round_messages
from mempo_trl.kit.tiny import load_tiny
from mempo_trl.memory import answer_probability
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rollout import RolloutEngine, memory_scoring_items
from mempo_trl.scoring import (
    answer_token_logps,
    pack_shared_prefix,
    shared_prefix_answer_logps,
)


def scripted_episodes(tokenizer, scripts, golds):
    """Play scripted episodes (one list of turn texts per row) through the real RolloutEngine."""
    engine = RolloutEngine(tokenizer, TurnProtocol(max_turns=max(len(s) for s in scripts)), EchoRetriever())
    rows = [{"question": f"Question {i}?", "golden_answers": g} for i, g in enumerate(golds)]
    by_question = {row["question"]: script for row, script in zip(rows, scripts)}

    def generate(prompts):
        outs = []
        for ids in prompts:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            script = next(s for q, s in by_question.items() if q in text)
            done = sum(1 for t in script if t in text)
            outs.append(tokenizer(script[done], add_special_tokens=False)["input_ids"])
        return outs, None

    episodes = engine.play(rows, generate).episodes
    return episodes


SCRIPTS = [
    [
        "<mem>nothing yet</mem><think>search</think><search>alpha river</search>",
        "<mem>alpha is north</mem><think>more</think><search>beta town</search>",
        "<mem>alpha north, beta town</mem><think>done</think><answer>Nordhaven</answer>",
    ],
    [
        "<mem>start</mem><think>go</think><search>gamma</search>",
        "<think>forgot the memory</think><answer>x</answer>",  # no <mem>: not scored
    ],
    [
        "<mem>a</mem><think>b</think><search>delta</search>",
        "<mem>delta seen</mem><think>c</think><answer>Delta City</answer>",
    ],
]
GOLDS = [["Nordhaven", "Nord Haven"], ["Oslo"], ["Delta City"]]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_tiny(tiny_model_dir)
    return model, tokenizer


@pytest.fixture(params=["tiny", "qwen2.5"])
def any_model(request, tiny):
    """The tiny model, and a random Qwen2.5-shaped one with Qwen2.5's real tokenizer (tags are several tokens)."""
    if request.param == "tiny":
        return tiny
    from transformers import AutoModelForCausalLM

    from mempo_trl.loading import load_tokenizer

    model_dir = request.getfixturevalue("qwen_model_dir")
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa"), load_tokenizer(model_dir)


def test_gold_mask_covers_only_the_gold_text(any_tokenizer):
    tokenizer = any_tokenizer
    ids, mask = gold_answer_tokens(tokenizer, ["Nord Haven", "x"])
    assert tokenizer.decode(ids) == "<answer> Nord Haven </answer>"
    gold = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(gold).strip() == "Nord Haven"
    assert "answer" not in tokenizer.decode(gold)


def test_scoring_items_follow_the_algorithm_doc(any_tokenizer):
    tokenizer = any_tokenizer
    episodes = scripted_episodes(tokenizer, SCRIPTS, GOLDS)
    pairs = memory_scoring_items(episodes[0], tokenizer)
    # Rounds 2 and 3 (index 1, 2) are scored; round 1 never is.
    assert [p.round_index for p in pairs] == [1, 2]
    history = episodes[0].history()
    base = episodes[0].base_messages
    for pair in pairs:
        t = pair.round_index
        assert pair.full.context_ids == render_prompt(tokenizer, round_messages(base, history[:t], "full_history"))
        mem_block = episodes[0].rounds[t].text[episodes[0].rounds[t].turn.mem_chars[0] :].split("<think>")[0]
        assert pair.mem.context_ids == render_prompt(tokenizer, base) + tokenizer(mem_block)["input_ids"]
        assert tokenizer.decode(pair.mem.context_ids).endswith("</mem>")
    # The second episode's round 2 has no <mem>: nothing to score.
    assert memory_scoring_items(episodes[1], tokenizer) == []
    assert [p.round_index for p in memory_scoring_items(episodes[2], tokenizer)] == [1]


def test_batched_scoring_equals_one_item_at_a_time(tiny):
    model, tokenizer = tiny
    episodes = scripted_episodes(tokenizer, SCRIPTS, GOLDS)
    items = [it for ep in episodes for p in memory_scoring_items(ep, tokenizer) for it in (p.full, p.mem)]
    batched, mask = answer_token_logps(model, items, tokenizer.pad_token_id, batch_size=4)
    for i, item in enumerate(items):
        alone, alone_mask = answer_token_logps(model, [item], tokenizer.pad_token_id)
        k = alone.size(1)
        torch.testing.assert_close(batched[i, :k], alone[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(mask[i, :k], alone_mask[0])
        assert not mask[i, k:].any()
    assert torch.isfinite(batched).all()


def test_shared_prefix_scoring_is_exact_and_cheaper(any_model):
    model, tokenizer = any_model
    scripts = [SCRIPTS[0] * 1, SCRIPTS[2]]
    episodes = scripted_episodes(tokenizer, scripts, [GOLDS[0], GOLDS[2]])
    keys, items = [], []
    for e, ep in enumerate(episodes):
        for pair in memory_scoring_items(ep, tokenizer):
            keys.append(e)
            items.append(pair.full)
    naive, naive_mask = answer_token_logps(model, items, tokenizer.pad_token_id, batch_size=8)
    shared, shared_mask = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id, batch_size=8)
    torch.testing.assert_close(shared, naive, atol=1e-4, rtol=1e-4)
    assert torch.equal(shared_mask, naive_mask)
    torch.testing.assert_close(
        answer_probability(shared, shared_mask, None), answer_probability(naive, naive_mask, None)
    )
    rows = pack_shared_prefix(items, keys)
    assert len(rows) == len(episodes)  # one sequence per trajectory
    naive_tokens = sum(len(it.context_ids) + len(it.answer_ids) for it in items)
    shared_tokens = sum(len(prefix) + sum(len(items[i].answer_ids) for i in idx) for prefix, idx in rows)
    assert shared_tokens < naive_tokens


def test_contexts_that_only_share_a_head_join_a_row_and_score_exactly(any_model):
    """The memory contexts of a question share the system and user messages, not each other: each becomes a block
    holding its own tail (the `<mem>`) and its answer, still exact."""
    model, tokenizer = any_model
    episodes = scripted_episodes(tokenizer, SCRIPTS, GOLDS)
    pairs = [p for ep in episodes for p in memory_scoring_items(ep, tokenizer)]
    items = [pairs[0].full, pairs[1].full, pairs[0].mem, pairs[1].mem] + [p.mem for p in pairs[2:]]
    keys = [0, 0, 0, 0] + [1] * (len(pairs) - 2)
    rows = pack_shared_prefix(items, keys)
    assert sorted(sorted(idx) for _, idx in rows) == [[0, 1, 2, 3], list(range(4, len(items)))]
    shared, shared_mask = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id)
    naive, naive_mask = answer_token_logps(model, items, tokenizer.pad_token_id)
    torch.testing.assert_close(shared, naive, atol=1e-4, rtol=1e-4)
    assert torch.equal(shared_mask, naive_mask)


def test_rows_are_capped_and_unrelated_contexts_get_their_own_row():
    item = ScoringItem(list(range(1, 11)), [7, 8], [1, 1])  # a 10-token context
    tails = [ScoringItem([1, 2, 3, 90 + j], [7, 8], [1, 1]) for j in range(8)]  # blocks of 7 + 2 tokens
    stranger = ScoringItem([5, 6], [7, 8], [1, 1])  # shares no token with the prefix
    rows = pack_shared_prefix([item, *tails, stranger], [0] * 10, max_block_tokens=20)
    # Budget max(10, 20) = 20 block tokens: the prefix's own block (2) + 6 tails (3 each: 1 token + answer).
    assert [idx for _, idx in rows] == [[0, 1, 2, 3, 4, 5, 6], [7, 8], [9]]
    assert rows[1][0] == tails[6].context_ids and rows[2][0] == stranger.context_ids


def test_placeholder_forwards_keep_processes_in_step(tiny):
    model, tokenizer = tiny
    episodes = scripted_episodes(tokenizer, SCRIPTS, GOLDS)
    items = [memory_scoring_items(episodes[2], tokenizer)[0].full]
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        logps, _ = answer_token_logps(model, items, tokenizer.pad_token_id, batch_size=8, num_chunks=3)
        shared_prefix_answer_logps(model, [], [], tokenizer.pad_token_id, batch_size=8, num_chunks=2)
    finally:
        handle.remove()
    assert len(calls) == 3 + 2 * 2  # a shared-prefix chunk is two forwards (prefix, then blocks)
    assert logps.shape[0] == 1
    with pytest.raises(ValueError, match="num_chunks"):
        answer_token_logps(model, items * 9, tokenizer.pad_token_id, batch_size=8, num_chunks=1)


def _full_items(tokenizer):
    episodes = scripted_episodes(tokenizer, [SCRIPTS[0], SCRIPTS[2]], [GOLDS[0], GOLDS[2]])
    keys, items = [], []
    for e, ep in enumerate(episodes):
        for pair in memory_scoring_items(ep, tokenizer):
            keys.append(e)
            items.append(pair.full)
    return items, keys


def test_scoring_forwards_keep_no_cache_and_feed_the_head_each_rows_own_positions(tiny):
    model, tokenizer = tiny
    items, keys = _full_items(tokenizer)
    calls, head_outputs = [], []
    hooks = [
        model.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(dict(kwargs)), with_kwargs=True),
        model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: head_outputs.append(out.shape)),
    ]
    try:
        answer_token_logps(model, items, tokenizer.pad_token_id)
        shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id, batch_size=8)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls[0]["use_cache"] is False
    # Shared prefix: pass 1 forwards one prefix per trajectory into a cache (head on its last position only) ...
    prefix_pass, block_pass = calls[1:]
    assert prefix_pass["input_ids"].shape[0] == 2 and prefix_pass["logits_to_keep"] == 1
    assert "attention_mask" not in prefix_pass  # plain causal attention
    cache = next(k for k in ("cache", "past_key_values") if k in prefix_pass)  # transformers >= 5.24: `cache`
    assert block_pass[cache] is prefix_pass[cache]
    assert head_outputs[1] == (2, 1, model.config.vocab_size)
    # ... pass 2 the answer blocks over it, the head seeing exactly one position per answer token.
    answer_tokens = sum(len(it.answer_ids) for it in items)
    per_row = [sum(len(it.answer_ids) for it, key in zip(items, keys) if key == k) for k in (0, 1)]
    assert block_pass["input_ids"].shape == (2, max(per_row))  # a full-history block is just its answer
    assert head_outputs[2] == (answer_tokens, model.config.vocab_size)


def test_shared_prefix_mask_is_built_in_the_models_dtype(tiny):
    model, tokenizer = tiny
    items, keys = _full_items(tokenizer)
    double = copy.deepcopy(model).double()
    masks = []
    hook = double.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
    )
    try:
        logps64, mask64 = shared_prefix_answer_logps(double, items, keys, tokenizer.pad_token_id)
    finally:
        hook.remove()
    assert masks[0] is None  # the prefixes: plain causal attention
    assert masks[1].dtype == torch.float64 and masks[1].device == next(double.parameters()).device
    logps32, mask32 = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id)
    assert torch.equal(mask64, mask32)
    torch.testing.assert_close(logps64.float(), logps32, atol=1e-4, rtol=1e-4)


def test_scoring_is_dropout_free_and_restores_train_mode(tiny):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = tiny
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(copy.deepcopy(base), config)
    model.train()
    items, keys = _full_items(tokenizer)
    ids = torch.tensor([items[0].context_ids])
    with torch.no_grad():  # the dropout is real: two train-mode forwards differ
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    for score in (
        lambda: answer_token_logps(model, items, tokenizer.pad_token_id),
        lambda: shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id),
    ):
        first, second = score(), score()
        assert torch.equal(first[0], second[0])
        assert all(module.training for module in model.modules())


def test_the_cache_goes_by_the_name_the_wrapped_models_forward_takes(tiny):
    """transformers renamed `past_key_values` to `cache` (5.24; 5.23 is in range): the name is looked up on the
    innermost model, so a PEFT-wrapped model is scored without a deprecation warning."""
    from peft import LoraConfig, get_peft_model

    base, tokenizer = tiny
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    items, keys = _full_items(tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id)


def test_scored_logps_are_the_trained_models_next_token_logps():
    """Both scorers against one plain forward per item, on the shipped learner: a trained model puts its mass on the
    right next token, so reading the log-prob one position off (answer token j from the logits of position j instead
    of j - 1) moves log p by whole units, far outside the tolerance (a random model's flat distribution hides it)."""
    from mempo_trl.kit.learner import shipped_learner

    model, tokenizer = load_tiny(shipped_learner())
    model.eval()
    episodes = scripted_episodes(tokenizer, SCRIPTS, GOLDS)
    keys, items = [], []
    for e, ep in enumerate(episodes):
        for pair in memory_scoring_items(ep, tokenizer):
            keys += [e, ("mem", e)]
            items += [pair.full, pair.mem]
    expected = []
    with torch.no_grad():
        for item in items:
            ids = torch.tensor([item.context_ids + item.answer_ids])
            logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(item.context_ids)
            expected.append([logps[start + j - 1, t].item() for j, t in enumerate(item.answer_ids)])
    for scorer in ("batched", "shared_prefix"):
        if scorer == "batched":
            logps, mask = answer_token_logps(model, items, tokenizer.pad_token_id, batch_size=3)
        else:
            logps, mask = shared_prefix_answer_logps(model, items, keys, tokenizer.pad_token_id, batch_size=3)
        for i, item in enumerate(items):
            n = len(item.answer_ids)
            assert mask[i, :n].tolist() == [bool(m) for m in item.answer_mask] and not mask[i, n:].any()
            gold = mask[i, :n]
            torch.testing.assert_close(logps[i, :n][gold], torch.tensor(expected[i])[gold], atol=1e-4, rtol=1e-4)


def test_scoring_pairs_carry_the_part_of_each_answer_token(any_tokenizer):
    """The rollout's scoring pairs hold `gold_answer_parts` of their row: one part per sub-answer of a multi-part
    row (what ``memory_reward_parts="weakest"`` reads), the gold tokens of a single answer."""
    tokenizer = any_tokenizer
    episode = scripted_episodes(tokenizer, SCRIPTS[:1], GOLDS[:1])[0]
    (single, *_) = memory_scoring_items(episode, tokenizer)
    assert single.answer_parts == tuple(gold_answer_tokens(tokenizer, GOLDS[0])[1])
    episode.row["sub_answers"] = [["Nord"], ["haven"]]
    (multi, *_) = memory_scoring_items(episode, tokenizer)
    assert multi.answer_parts == tuple(gold_answer_parts(tokenizer, GOLDS[0], [["Nord"], ["haven"]]))
    assert set(multi.answer_parts) == {0, 1, 2} and len(multi.answer_parts) == len(multi.full.answer_ids)
