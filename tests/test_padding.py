"""The padded round batch (`mempo_trl.padding.round_tensors`): widths, placeholder rows and the masked completions of
dropped and truncated rows, on hand-written rows."""

import doctest
from types import SimpleNamespace

import mempo_trl.padding as padding
from mempo_trl.padding import round_tensors


def row(prompt, completion, truncated=False):
    return SimpleNamespace(prompt_ids=prompt, completion_ids=completion, truncated=truncated)


def test_doctests():
    assert doctest.testmod(padding).failed == 0


def test_rows_and_placeholders_are_padded_to_one_batch():
    rows = [row([1, 2, 3], [4, 5]), row([6], [7, 8, 9], truncated=True), row([2, 2], [3])]
    batch = round_tensors(rows, [True, True, False], placeholders=1, pad_id=0, mask_truncated=True)
    assert batch["prompt_ids"].tolist() == [[1, 2, 3], [0, 0, 6], [0, 2, 2], [0, 0, 0]]
    assert batch["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1], [0, 0, 1]]
    assert batch["completion_ids"].tolist() == [[4, 5, 0], [7, 8, 9], [3, 0, 0], [0, 0, 0]]
    # row 2 truncated, row 3 not kept (its episode dropped), row 4 a placeholder: completions fully masked
    assert batch["completion_mask"].tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert batch["real_rows"].tolist() == [True, True, False, False]


def test_truncated_rows_train_unless_masked_and_widths_round_up():
    rows = [row([1], [4, 5, 6], truncated=True)]
    batch = round_tensors(rows, [True], placeholders=0, pad_id=9, pad_to_multiple_of=4)
    assert batch["prompt_ids"].tolist() == [[9, 9, 9, 1]]
    assert batch["completion_ids"].tolist() == [[4, 5, 6, 9]]
    assert batch["completion_mask"].tolist() == [[1, 1, 1, 0]]
