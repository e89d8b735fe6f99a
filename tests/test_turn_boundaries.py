"""Turn boundaries under the tiny tokenizer and Qwen2.5's real one: cutting, parsing, spans, contexts, gold masks.

Under Qwen2.5 the MemPO tags are several tokens and a tag's last ``>`` merges with what follows (``><``, ``></``,
``>\\n``); a turn must still end exactly at its action tag in text, keep the sampled token in ids, and never be
invalid because of what the model wrote after its action.
"""

import doctest

import pytest
from helpers import EchoRetriever
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mempo_trl.kit.qwen as qwen_module
from mempo_trl.context import gold_answer_parts, gold_answer_tokens, render_prompt, round_messages
from mempo_trl.kit.tiny import qwen2_5_chat_template
from mempo_trl.offsets import locate_mem_span
from mempo_trl.protocol import TurnProtocol
from mempo_trl.rollout import RolloutEngine, cut_after_action, memory_scoring_items
from mempo_trl.turns import MEMPO_TAGS, parse_turn


# ------------------------------------------------------------------------------------------- the real tokenizer


def test_qwen_tokenizer_matches_qwen2_5(qwen_tokenizer):
    tok = qwen_tokenizer
    assert tok("Hello world, how are you?").input_ids == [9707, 1879, 11, 1246, 525, 498, 30]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.convert_tokens_to_ids(["<tool_call>", "<|file_sep|>"]) == [151657, 151664]
    assert len(tok) == 151665 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == qwen2_5_chat_template()
    # Multi-token tags, merged with what follows: the case this file is about.
    assert tok.convert_ids_to_tokens(tok("</search><information>").input_ids) == [
        "</",
        "search",
        "><",
        "information",
        ">",
    ]
    assert tok.convert_ids_to_tokens(tok("</answer></").input_ids) == ["</", "answer", "></"]
    # Special tokens stay whole; the normalizer is NFC; one token per digit.
    assert tok("a<|im_end|>b").input_ids[1] == 151645
    assert tok("e\u0301").input_ids == tok("\u00e9").input_ids
    assert len(tok("2026").input_ids) == 4
    text = "<mem> Ulm é 中文 🙂 </mem>\n<think>x</think>"
    assert tok.decode(tok(text).input_ids) == text


def test_qwen_tokenizer_is_cached(tmp_path, monkeypatch):
    first = qwen_module.build_qwen2_5_tokenizer(cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert (entry / "tokenizer.json").is_file()
    monkeypatch.setattr(qwen_module, "_convert", lambda _: pytest.fail("rebuilt despite the cache"))
    second = qwen_module.build_qwen2_5_tokenizer(cache_dir=tmp_path)
    sample = "<mem>a</mem><think>b</think><search>c</search><|im_end|>"
    assert second(sample).input_ids == first(sample).input_ids


def test_qwen_model_dir_loads_like_a_hub_model(qwen_model_dir, qwen_tokenizer):
    from transformers import Qwen2ForCausalLM

    from mempo_trl.loading import load_tokenizer

    model = Qwen2ForCausalLM.from_pretrained(qwen_model_dir)
    assert model.get_input_embeddings().weight.shape == (151936, 64)
    assert model.model.layers[0].self_attn.head_dim == 32
    assert model.generation_config.eos_token_id == [151645, 151643]
    tokenizer = load_tokenizer(qwen_model_dir)
    assert tokenizer("Hello world, how are you?").input_ids == [9707, 1879, 11, 1246, 525, 498, 30]
    assert tokenizer.chat_template == qwen_tokenizer.chat_template


def test_doctests():
    assert doctest.testmod(qwen_module, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------------------------------ the boundary policy

TURN_SEARCH = "<mem> Ulm is a city </mem>\n<think> need the mayor </think>\n<search> mayor of Ulm </search>"
TURN_ANSWER = "<mem>Max is mayor</mem><think>done</think><answer>Max Müller</answer>"
AFTER = [
    "",
    "<information>Doc 1(Title: made up) text</information>",
    "</search>",
    "</answer>",
    "\n",
    "\n\nUser: thanks",
    " <search> again </search>",
    "><",
    "中文 🙂",
    "<|im_end|>",
    "<|endoftext|>garbage",
]


def _expected_kept(ids, tokenizer, turn):
    """Brute force: the shortest prefix whose text (special tokens skipped) holds the whole turn."""
    return next(
        ids[:k] for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k], skip_special_tokens=True).startswith(turn)
    )


@pytest.mark.parametrize("after", AFTER)
@pytest.mark.parametrize("turn", [TURN_SEARCH, TURN_ANSWER])
def test_turn_text_ends_at_the_action_and_ids_keep_the_sampled_token(any_tokenizer, turn, after):
    tok = any_tokenizer
    ids = tok(turn + after, add_special_tokens=False).input_ids
    kept, text, truncated = cut_after_action(ids, tok, [tok.eos_token_id])
    assert text == turn and parse_turn(text).valid and not truncated
    assert kept == _expected_kept(ids, tok, turn)
    assert ids[: len(kept)] == kept  # a prefix of what was sampled, never re-tokenized


def test_merged_token_is_kept_in_ids_but_not_in_text(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok(TURN_SEARCH + "<information>x").input_ids
    kept, text, _ = cut_after_action(ids, tok, [tok.eos_token_id])
    assert tok.convert_ids_to_tokens(kept[-1:]) == ["><"]
    assert tok.decode(kept).endswith("</search><") and text.endswith("</search>")


def test_without_action_the_completion_is_kept_whole(any_tokenizer):
    tok = any_tokenizer
    ids = tok("<mem>m</mem><think>t</think><answer>unfinished", add_special_tokens=False).input_ids
    assert cut_after_action(ids, tok, [tok.eos_token_id]) == (ids, tok.decode(ids), True)
    ended = ids + [tok.eos_token_id]
    assert cut_after_action(ended, tok, [tok.eos_token_id]) == (ended, tok.decode(ids), False)


SPECIALS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>", "<tool_call>"]
junk = st.lists(
    st.one_of(st.text(max_size=8), st.sampled_from([*MEMPO_TAGS, *SPECIALS, "<", ">", "</", "\n", " ", "><"])),
    max_size=8,
).map("".join)
space = st.sampled_from(["", " ", "\n", "\n\n", " \n ", "\t"])
inner = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def turns(draw):
    """A valid turn with random whitespace around its tags and random non-empty inner texts."""
    action = draw(st.sampled_from(["search", "answer"]))
    content = draw(inner.filter(str.strip))
    s = [draw(space) for _ in range(4)]
    return f"{s[0]}<mem>{draw(inner)}</mem>{s[1]}<think>{draw(inner)}</think>{s[2]}<{action}>{content}</{action}>"


@pytest.mark.parametrize("name", ["qwen2.5", "smollm2"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turn=turns(), after=junk)
def test_fuzz_any_text_after_the_action_under_real_tokenizers(real_tokenizers, name, turn, after):
    tok = real_tokenizers[name]
    if not parse_turn(turn).valid or tok.decode(tok(turn).input_ids) != turn:
        return  # NFC-changed or invalid (e.g. whitespace-only content) drafts are not turns
    ids = tok(turn + after, add_special_tokens=False).input_ids
    kept, text, truncated = cut_after_action(ids, tok, [tok.eos_token_id])
    assert text == turn and not truncated
    assert parse_turn(text) == parse_turn(turn)
    assert kept == _expected_kept(ids, tok, turn)
    span = locate_mem_span(kept, tok)
    first, last = span
    block = turn[slice(*parse_turn(turn).mem_chars)]
    assert block in tok.decode(kept[first : last + 1])
    assert block not in tok.decode(kept[first + 1 : last + 1]) and block not in tok.decode(kept[first:last])


# ------------------------------------------------------------------ rollout, context rebuild, scoring items, masks


SCRIPT = [
    "<mem>nothing yet</mem><think>search</think><search>alpha river</search>",
    "<mem>alpha is north</mem>\n<think>more</think>\n<search>beta town</search>",
    "<mem>alpha north, beta town</mem> <think>done</think> <answer>Nordhaven</answer>",
]
CHATTER = "<information>Doc 1(Title: invented) more</information></answer>\n"


@pytest.mark.parametrize("chatter", ["", CHATTER])
def test_rollout_with_a_model_that_keeps_talking(any_tokenizer, chatter):
    tok = any_tokenizer
    engine = RolloutEngine(tok, TurnProtocol(max_turns=3), EchoRetriever())

    def generate(prompts):
        outs = []
        for ids in prompts:
            done = 1 + max((k for k, t in enumerate(SCRIPT) if t in tok.decode(ids)), default=-1)
            outs.append(tok(SCRIPT[done] + chatter, add_special_tokens=False).input_ids)
        return outs, None

    (episode,) = engine.play([{"question": "Where is Nordhaven?", "golden_answers": ["Nordhaven"]}], generate).episodes
    assert [r.text for r in episode.rounds] == SCRIPT
    assert episode.format_valid and episode.answer == "Nordhaven"
    for t, record in enumerate(episode.rounds):
        sampled = tok(SCRIPT[t] + chatter, add_special_tokens=False).input_ids
        assert record.completion_ids == _expected_kept(sampled, tok, SCRIPT[t])
        first, last = record.mem_span
        block = SCRIPT[t][slice(*record.turn.mem_chars)]
        assert block in tok.decode(record.completion_ids[first : last + 1])
        assert block not in tok.decode(record.completion_ids[first + 1 : last + 1])
        assert block not in tok.decode(record.completion_ids[first:last])
        # The next context is rebuilt from the clean turn text, never from the chatter.
        expected = render_prompt(tok, round_messages(episode.base_messages, episode.history()[:t][-1:], "memory"))
        assert record.prompt_ids == expected
    assert "invented" not in tok.decode(episode.rounds[-1].prompt_ids)

    pairs = memory_scoring_items(episode, tok)
    assert [p.round_index for p in pairs] == [1, 2]
    for pair in pairs:
        block = SCRIPT[pair.round_index].split("<think>")[0].strip()
        assert tok.decode(pair.mem.context_ids).endswith("<|im_start|>assistant\n" + block)
        assert "invented" not in tok.decode(pair.full.context_ids)


@pytest.mark.parametrize("gold", ["Nord Haven", "Max Müller", "U.S.", "1990", "(a) b", "中文 🙂", "x<y>", "A; B"])
def test_gold_mask_covers_exactly_the_gold_tokens(any_tokenizer, gold):
    tok = any_tokenizer
    ids, mask = gold_answer_tokens(tok, [gold])
    assert tok.decode(ids) == f"<answer> {gold} </answer>"
    first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
    assert all(mask[first : last + 1])
    assert tok.decode(ids[first : last + 1]).strip() == gold  # only a leading space beside the gold text
    assert "answer" not in tok.decode(ids[first : last + 1])


@pytest.mark.parametrize(
    "parts", [[["Ulm"], ["Max Planck", "Planck"], ["1879"]], [["A; B"], ["中文 🙂"]], [["x"], ["x"]]]
)
def test_gold_answer_parts_mark_each_sub_answer_and_nothing_else(any_tokenizer, parts):
    """`memory_reward_parts="weakest"` reads each part's tokens: part k's tokens decode to its first alias, the tags and
    the ``"; "`` between parts are in no part, and every part token is a gold token."""
    tok = any_tokenizer
    ids, mask = gold_answer_tokens(tok, [], parts)
    marks = gold_answer_parts(tok, [], parts)
    assert len(marks) == len(ids) and all(mask[i] for i, m in enumerate(marks) if m)
    for k, aliases in enumerate(parts, start=1):
        assert tok.decode([i for i, m in zip(ids, marks) if m == k]).strip() == aliases[0]
    assert gold_answer_parts(tok, ["Nord Haven"]) == gold_answer_tokens(tok, ["Nord Haven"])[1]  # one part: the gold
