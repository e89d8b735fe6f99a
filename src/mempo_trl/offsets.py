"""Token offsets: where a character span of a decoded turn lies in its token ids, exact for any tokenizer."""

import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from mempo_trl.turns import SEARCH_ACTIONS, parse_turn


def locate_char_span(offsets: Sequence[tuple[int, int]], char_start: int, char_end: int) -> tuple[int, int] | None:
    """Inclusive token indices of the first token covering ``char_start`` and the last covering ``char_end - 1``.

    ``offsets`` are per-token ``[start, end)`` char offsets; ``None`` if the span is empty or not covered.

    >>> locate_char_span([(0, 3), (3, 5), (5, 5), (5, 9)], 4, 6)
    (1, 3)
    """
    if char_end <= char_start:
        return None
    first = next((i for i, (s, e) in enumerate(offsets) if s <= char_start < e), None)
    last = next((i for i in reversed(range(len(offsets))) if offsets[i][0] <= char_end - 1 < offsets[i][1]), None)
    if first is None or last is None:
        return None
    return first, last


def _stream_pieces(backend: Tokenizer, ids: list[int], text: str) -> list[str] | None:
    """Per-token text pieces from streaming decoding, or ``None`` if they do not concatenate to ``text``.

    The stream holds text back while a token ends inside a multi-byte char (``" \\xef"`` of ``" ﬁ"``) and releases
    it with a later token; the released text is split back over those tokens, each keeping the chars it completes.
    """
    stream = DecodeStream(skip_special_tokens=False)
    pieces: list[str] = []
    held = 0  # tokens at the end of `pieces` whose text the stream holds back
    try:
        for i, token_id in enumerate(ids):
            piece = stream.step(backend, token_id)
            if piece is None:
                pieces.append("")
                held += 1
                continue
            if held:
                start, done = i - held, 0
                for k in range(start, i):
                    window = backend.decode(ids[start : k + 1], skip_special_tokens=False)
                    end = max(done, len(os.path.commonprefix([window, piece])))
                    pieces[k], done = piece[done:end], end
                piece, held = piece[done:], 0
            pieces.append(piece)
    except Exception:  # decoders that rewrite across tokens make the stream raise "Invalid prefix"
        return None
    return pieces if "".join(pieces) == text else None


def token_char_offsets(token_ids: Sequence[int], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """Decoded text (special tokens kept) and each token's exact ``[start, end)`` char offsets in it.

    A char belongs to the token that completes it, so a token holding only the leading bytes of a multi-byte char
    gets an empty span; the spans tile the text. ``tokenizer`` is a HF fast tokenizer, a ``tokenizers.Tokenizer``,
    or anything with ``decode(ids, skip_special_tokens=False)``. Fast path: O(n) streaming decoding, checked against
    the full decode; otherwise the offsets come from decoding every prefix (the common prefix with the full text).

    >>> token_char_offsets([5, 6], tokenizer)  # doctest: +SKIP
    ('<mem>', [(0, 4), (4, 5)])
    """
    ids = [int(t) for t in token_ids]
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        text = backend.decode(ids, skip_special_tokens=False)
        pieces = _stream_pieces(backend, ids, text)
        if pieces is not None:
            offsets, start = [], 0
            for piece in pieces:
                offsets.append((start, start + len(piece)))
                start += len(piece)
            return text, offsets

        def decode(prefix: list[int]) -> str:
            return backend.decode(prefix, skip_special_tokens=False)

    else:

        def decode(prefix: list[int]) -> str:
            return tokenizer.decode(prefix, skip_special_tokens=False)

    text = decode(ids)
    bounds = [0]
    for i in range(1, len(ids)):
        common = len(os.path.commonprefix([decode(ids[:i]), text]))
        bounds.append(max(bounds[-1], common))
    bounds.append(len(text))
    return text, list(zip(bounds[:-1], bounds[1:]))[: len(ids)]


def locate_mem_span(
    token_ids: Sequence[int], tokenizer: Any, actions: tuple[str, ...] = SEARCH_ACTIONS
) -> tuple[int, int] | None:
    """Inclusive token indices from the first token of ``<mem>`` to the last of ``</mem>`` in one turn's ids.

    Uses the well-formed mem block of :func:`parse_turn` on the decoded text; exact whether a tag is one token or
    several. ``None`` when the turn has no well-formed mem block.

    >>> locate_mem_span(tokenizer.encode("<mem>a</mem><think>b</think>"), tokenizer)  # doctest: +SKIP
    (0, 2)
    """
    text, offsets = token_char_offsets(token_ids, tokenizer)
    span = parse_turn(text, actions).mem_chars
    return None if span is None else locate_char_span(offsets, *span)
