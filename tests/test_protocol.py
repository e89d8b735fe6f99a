import doctest
import os
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import mempo_trl.context as context
import mempo_trl.offsets as offsets
import mempo_trl.protocol as protocol
import mempo_trl.turns as turns
from mempo_trl.context import render_gold_answer, render_information
from mempo_trl.offsets import locate_char_span, locate_mem_span, token_char_offsets
from mempo_trl.turns import MEMPO_TAGS, parse_turn, split_answers


@pytest.mark.parametrize("module", [turns, offsets, context, protocol])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# ----------------------------------------------------------------------------------------------------- parse_turn


def test_parse_valid_search_turn():
    text = "\n<mem> Ulm is the city </mem>\n<think>need mayor</think>\n\n<search>  mayor of Ulm </search>\n"
    turn = parse_turn(text)
    assert turn.valid and turn.reason is None
    assert (turn.mem, turn.think, turn.action, turn.content) == (
        "Ulm is the city",
        "need mayor",
        "search",
        "mayor of Ulm",
    )
    start, end = turn.mem_chars
    assert text[start:end] == "<mem> Ulm is the city </mem>"


def test_parse_valid_answer_turn_allows_empty_mem_and_other_angle_brackets():
    turn = parse_turn("<mem></mem><think>a < b and <memo></think><answer>Ulm; Max</answer>")
    assert turn.valid
    assert (turn.mem, turn.think, turn.action, turn.content, turn.mem_chars) == (
        "",
        "a < b and <memo>",
        "answer",
        "Ulm; Max",
        (0, 11),
    )


M, T, S, A = "<mem>m</mem>", "<think>t</think>", "<search>q</search>", "<answer>x</answer>"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no tags"),
        ("just text", "no tags"),
        (f"{T}{S}", "missing <mem>"),
        (f"{M}{S}", "missing <think>"),
        (f"{M}{M}{T}{S}", "repeated <mem>"),
        (f"{M}{T}{T}{S}", "repeated <think>"),
        (f"{M}{T}", "no action"),
        (f"{M}{T}{S}{A}", "more than one action"),
        (f"{M}{T}{S}{S}", "more than one action"),
        (f"{T}{M}{S}", "out of order"),
        (f"{M}{S}{T}", "out of order"),
        (f"<mem>m{T}{S}", "inside the unclosed <mem>"),
        (f"{M}{T}<search>q", "unclosed <search>"),
        (f"{M}{T}<search>q</answer>", "</answer> closes <search>"),
        (f"</mem>{M}{T}{S}", "</mem> without"),
        (f"Sure! {M}{T}{S}", "text outside tags before <mem>"),
        (f"{M} and {T}{S}", "text outside tags before <think>"),
        (f"{M}{T}{S} done", "text outside tags"),
        (f"{M}{T}{S}<information>x</information>", "<information>"),
        (f"{M}{T}<search>  </search>", "empty <search>"),
        (f"{M}{T}<answer></answer>", "empty <answer>"),
    ],
)
def test_parse_invalid_reasons(text, reason):
    turn = parse_turn(text)
    assert not turn.valid
    assert reason in turn.reason
    assert turn.think is None and turn.action is None and turn.content is None


def test_mem_chars_kept_for_invalid_turn_and_dropped_for_broken_mem():
    text = f"Sure! {M}{T}{S}{A}"
    turn = parse_turn(text)
    assert not turn.valid and turn.mem == "m" and text[slice(*turn.mem_chars)] == M
    assert parse_turn("<mem>a<think>b</think></mem>").mem_chars is None
    assert parse_turn("<mem>a").mem_chars is None
    assert parse_turn(f"{T}{S}").mem_chars is None


FRAGMENTS = (*MEMPO_TAGS, "<", ">", "/", "mem", "think", "<mem", "mem>", "</", " ", "\n", "x", "é", "中")
texts_with_tags = st.one_of(st.text(), st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3)).map("".join))


@settings(max_examples=300, deadline=None)
@given(texts_with_tags)
def test_parse_never_raises_and_is_consistent(text):
    turn = parse_turn(text)
    assert turn.valid == (turn.reason is None)
    if turn.mem_chars is not None:
        block = text[slice(*turn.mem_chars)]
        assert block.startswith("<mem>") and block.endswith("</mem>")
        assert block[len("<mem>") : -len("</mem>")].strip() == turn.mem
    if turn.valid:
        assert turn.action in ("search", "answer") and turn.content and turn.mem_chars is not None


plain = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=20)
nonempty = plain.filter(lambda s: s.strip() != "")
space = st.sampled_from(["", " ", "\n", " \n\t "])


@st.composite
def turn_parts(draw):
    """A valid turn as a list of pieces: 6 tags, 3 contents and 4 whitespace separators."""
    action = draw(st.sampled_from(["search", "answer"]))
    texts = [draw(plain), draw(plain), draw(nonempty)]
    seps = [draw(space) for _ in range(4)]
    parts = [seps[0]]
    for name, body, sep in zip(["mem", "think", action], texts, seps[1:]):
        parts += [f"<{name}>", body, f"</{name}>", sep]
    return action, texts, parts


@settings(max_examples=200, deadline=None)
@given(turn_parts())
def test_valid_turn_round_trips(case):
    action, (mem, think, content), parts = case
    text = "".join(parts)
    turn = parse_turn(text)
    assert turn.valid, turn.reason
    assert (turn.mem, turn.think, turn.action, turn.content) == (mem.strip(), think.strip(), action, content.strip())
    assert turn.mem_chars == (len(parts[0]), len(parts[0]) + len(f"<mem>{mem}</mem>"))


TAG_POSITIONS = [1, 3, 5, 7, 9, 11]  # indices of the tags in the parts list
BLOCKS = [(1, 4), (5, 8), (9, 12)]


def _damage(parts, kind, data):
    parts = list(parts)
    if kind == "drop":
        del parts[data.draw(st.sampled_from(TAG_POSITIONS))]
    elif kind == "duplicate_tag":
        i = data.draw(st.sampled_from(TAG_POSITIONS))
        parts.insert(i, parts[i])
    elif kind == "duplicate_block":
        a, b = data.draw(st.sampled_from(BLOCKS))
        parts[b:b] = parts[a:b]
    elif kind == "swap":
        (a1, b1), (a2, b2) = data.draw(st.permutations(BLOCKS))[:2]
        blocks = {a1: parts[a2:b2], a2: parts[a1:b1]}
        parts = (
            parts[:1] + [p for start, _ in BLOCKS for p in blocks.get(start, parts[start : start + 3])] + parts[12:]
        )
    elif kind == "outside_text":
        parts.insert(data.draw(st.sampled_from([0, 4, 8, 12, 13])), data.draw(nonempty))
    elif kind == "second_action":
        parts.insert(12, data.draw(st.sampled_from([S, A])))
    elif kind == "information":
        parts.insert(data.draw(st.integers(0, len(parts))), data.draw(st.sampled_from(MEMPO_TAGS[6:8])))
    return parts


@settings(max_examples=300, deadline=None)
@given(
    turn_parts(),
    st.sampled_from(
        ["drop", "duplicate_tag", "duplicate_block", "swap", "outside_text", "second_action", "information"]
    ),
    st.data(),
)
def test_any_damage_is_invalid(case, kind, data):
    _, _, parts = case
    damaged = "".join(_damage(parts, kind, data))
    assert damaged != "".join(parts)
    assert not parse_turn(damaged).valid


def test_split_answers():
    assert split_answers("Ulm ; Max") == ["Ulm", "Max"]
    assert split_answers("Ulm") == ["Ulm"]
    assert split_answers(";x;") == ["", "x", ""]


# ------------------------------------------------------------------------------------------- rendering helpers


@dataclass
class _Passage:
    id: str
    title: str
    text: str
    score: float


def test_render_information():
    passages = [_Passage("1", "Ulm", " A city in Germany. ", 3.0), {"title": "Einstein", "text": "Born in Ulm."}]
    assert render_information(passages) == (
        "<information>Doc 1(Title: Ulm) A city in Germany.\nDoc 2(Title: Einstein) Born in Ulm.</information>"
    )
    assert render_information([]) == "<information>No results.</information>"


def test_render_gold_answer():
    text, (start, end) = render_gold_answer([" Paris ", "paris"])
    assert text == "<answer> Paris </answer>" and text[start:end] == "Paris"
    text, (start, end) = render_gold_answer(["ignored"], [["Ulm", "Ulm, Germany"], ["Max"]])
    assert text == "<answer> Ulm; Max </answer>" and text[start:end] == "Ulm; Max"
    assert parse_turn(f"<mem></mem><think></think>{text}").content == "Ulm; Max"
    with pytest.raises(ValueError, match="golden_answers is empty"):
        render_gold_answer([])
    with pytest.raises(ValueError, match="at least one gold alias"):
        render_gold_answer(["x"], [["a"], []])


# ------------------------------------------------------------------------------------------------ span location


def test_locate_char_span_units():
    offsets = [(0, 2), (2, 5), (5, 5), (5, 6), (7, 9)]
    assert locate_char_span(offsets, 0, 9) == (0, 4)
    assert locate_char_span(offsets, 3, 5) == (1, 1)
    assert locate_char_span(offsets, 4, 6) == (1, 3)
    assert locate_char_span(offsets, 6, 8) is None  # char 6 is not covered
    assert locate_char_span(offsets, 3, 3) is None
    assert locate_char_span(offsets, 8, 12) is None
    assert locate_char_span([], 0, 1) is None


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "<mem> Einstein was born in Ulm </mem> <think> find the mayor </think> <search> mayor of Ulm </search>",
    "<information>Doc 1(Title: Ulm) Ulm is a city.</information> <answer> Gunter Czisch </answer>",
    "café naïve 中文 résumé",
]


def _train_tokenizer(add_tags):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    if add_tags:
        assert hf.add_tokens(list(MEMPO_TAGS)) == len(MEMPO_TAGS)
    return hf


TOKENIZERS = {"tags_added": _train_tokenizer(True), "tags_split": _train_tokenizer(False)}


def _token_byte_ranges(ids, tokenizer):
    """Byte range of each token: one byte per char of a byte-level BPE token string, UTF-8 for added tokens."""
    ranges, pos = [], 0
    added = tokenizer.get_added_vocab()
    for token in tokenizer.convert_ids_to_tokens(ids):
        size = len(token.encode()) if token in added else len(token)
        ranges.append((pos, pos + size))
        pos += size
    return ranges


def _brute_force_offsets(ids, tokenizer):
    """Each token ends where the longest common prefix of the full text and the decoded prefix ends."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    bounds = [0] + [len(os.path.commonprefix([tokenizer.decode(ids[:i]), text])) for i in range(1, len(ids))]
    bounds.append(len(text))
    return text, list(zip(bounds[:-1], bounds[1:]))[: len(ids)]


def _brute_force_mem_tokens(ids, tokenizer, text):
    """Tokens holding the first byte of ``<mem>`` and the last byte of ``</mem>`` of the parsed mem block."""
    span = parse_turn(text).mem_chars
    if span is None:
        return None
    first_byte, last_byte = len(text[: span[0]].encode()), len(text[: span[1]].encode()) - 1
    ranges = _token_byte_ranges(ids, tokenizer)
    first = next(i for i, (s, e) in enumerate(ranges) if s <= first_byte < e)
    last = next(i for i, (s, e) in enumerate(ranges) if s <= last_byte < e)
    return first, last


WORDS = ["the", " fox", " Ulm", "é", " café", "中文", "中", "🙂", " ", "\n", "ﬁ", "x", ":", "<", ">", "/", "mem"]
stream_texts = st.lists(st.sampled_from([*WORDS, *MEMPO_TAGS, "<|endoftext|>"]), max_size=30).map("".join)


@st.composite
def turn_like_texts(draw):
    """Random text around a mem block that holds random words, tags and non-ASCII chars."""
    inner = draw(st.lists(st.sampled_from(WORDS), max_size=12).map("".join))
    return draw(stream_texts) + f"<mem>{inner}</mem>" + draw(stream_texts)


# The real tokenizers (session fixture) next to the two toy ones: tags split and merged with their neighbours.
VARIANTS = [*sorted(TOKENIZERS), "qwen2.5", "smollm2"]


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=120, deadline=None)
@given(text=st.one_of(stream_texts, turn_like_texts()))
def test_offsets_and_mem_span_agree_with_brute_force(variant, text, real_tokenizers):
    tokenizer = {**TOKENIZERS, **real_tokenizers}[variant]
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded, offsets = token_char_offsets(ids, tokenizer)
    assert decoded == text
    assert (decoded, offsets) == _brute_force_offsets(ids, tokenizer)
    expected = _brute_force_mem_tokens(ids, tokenizer, text)
    assert locate_mem_span(ids, tokenizer) == expected
    if expected is not None:
        first, last = expected
        block = text[slice(*parse_turn(text).mem_chars)]
        assert block in tokenizer.decode(ids[first : last + 1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_mem_span_with_non_ascii_memory(variant, real_tokenizers):
    tokenizer = {**TOKENIZERS, **real_tokenizers}[variant]
    block = "<mem>Ulm é 中文 🙂 naïve</mem>"
    ids = tokenizer.encode(f" {block}\n<think>t</think><search>中文</search><|endoftext|>", add_special_tokens=False)
    first, last = locate_mem_span(ids, tokenizer)
    assert block in tokenizer.decode(ids[first : last + 1])
    assert block not in tokenizer.decode(ids[first + 1 : last + 1])
    assert block not in tokenizer.decode(ids[first:last])
    if variant == "tags_added":
        assert tokenizer.convert_ids_to_tokens([ids[first], ids[last]]) == ["<mem>", "</mem>"]


def test_no_mem_block_gives_none():
    tokenizer = TOKENIZERS["tags_split"]
    assert locate_mem_span(tokenizer.encode("<think>t</think><answer>x</answer>"), tokenizer) is None
    assert locate_mem_span([], tokenizer) is None
    assert token_char_offsets([], tokenizer) == ("", [])


class _DecodeOnly:
    """A tokenizer exposing only ``decode`` (no fast backend)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_prefix_decoding_fallback_without_backend():
    tokenizer = TOKENIZERS["tags_split"]
    ids = tokenizer.encode(" <mem>中文 🙂</mem><think>t</think>", add_special_tokens=False)
    assert token_char_offsets(ids, _DecodeOnly(tokenizer)) == token_char_offsets(ids, tokenizer)
    assert locate_mem_span(ids, _DecodeOnly(tokenizer)) == locate_mem_span(ids, tokenizer)


def test_fallback_when_the_stream_raises():
    # Fuse + Replace rewrites text across token boundaries ("a" "b" -> "X"), which makes DecodeStream raise.
    vocab = {"<unk>": 0, "a": 1, "b": 2, "<mem>": 3, "</mem>": 4, " ": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    ids = [1, 1, 3, 1, 2, 1, 4, 2]
    text, offsets = token_char_offsets(ids, tok)
    assert text == "aa<mem>Xa</mem>b"
    assert offsets == [(0, 1), (1, 2), (2, 7), (7, 7), (7, 8), (8, 9), (9, 15), (15, 16)]
    assert locate_mem_span(ids, tok) == (2, 6)


def test_fallback_when_stream_pieces_do_not_add_up(monkeypatch):
    class _WrongStream:
        def __init__(self, skip_special_tokens):
            pass

        def step(self, tokenizer, token_id):
            return "?"

    tokenizer = TOKENIZERS["tags_added"]
    ids = tokenizer.encode("x <mem>中文</mem>", add_special_tokens=False)
    expected = token_char_offsets(ids, tokenizer)
    monkeypatch.setattr(offsets, "DecodeStream", _WrongStream)
    assert token_char_offsets(ids, tokenizer) == expected == _brute_force_offsets(ids, tokenizer)


def test_held_back_stream_text_goes_to_the_tokens_that_complete_it(qwen_tokenizer):
    # " ﬁ" is two Qwen2.5 tokens, " \xef" and "\xac\x81": the space is complete after the first one.
    ids = qwen_tokenizer.encode(" ﬁ<mem>ﬁ</mem>", add_special_tokens=False)
    assert token_char_offsets(ids, qwen_tokenizer) == _brute_force_offsets(ids, qwen_tokenizer)
    assert token_char_offsets(ids[:2], qwen_tokenizer) == (" ﬁ", [(0, 1), (1, 2)])
