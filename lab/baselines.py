"""The kit-free baselines a user compares a search agent with: answer with no retrieval, or after one search.

Both prompt the model with its chat template and greedy decoding, outside the MemPO turn protocol, as a user would
try a chat model on the questions first:

- ``no_retrieval``: the question alone;
- ``one_search``: the question's top-k passages (one BM25 search with the question as the query), then the question.

The answer is the first line of the reply (what a short-answer prompt gets back), scored with the library's EM and
F1 (`mempo_trl.rewards`) against every alias; the prompt and reply tokens are counted as `mempo-trl eval` counts them.
"""

from collections.abc import Sequence
from typing import Any

from mempo_trl.context import render_information
from mempo_trl.rewards import exact_match, f1_score


BASELINES = ("no_retrieval", "one_search")
"""The baselines, in the order the summary lists them."""

SYSTEM = "Answer the question with a short answer only: a name, a date, a number, yes or no. No explanation."


def baseline_messages(question: str, passages: Sequence[Any] | None) -> list[dict]:
    """The chat of one baseline question: the system line, then the passages (``one_search``) and the question.

    >>> baseline_messages("Who?", None)[1]["content"]
    'Question: Who?'
    """
    documents = f"{render_information(passages)}\n" if passages else ""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{documents}Question: {question}"}]


def first_line(reply: str) -> str:
    """The answer a short-answer reply gives: its first non-blank line, without a leading ``Answer:``.

    >>> first_line("\\n Answer: Paris\\nIt is the capital.")
    'Paris'
    """
    for line in reply.splitlines():
        line = line.strip()
        if line:
            return line.removeprefix("Answer:").strip()
    return ""


def run_baseline(
    model,
    tokenizer,
    rows: Sequence[dict],
    retriever=None,
    topk: int = 3,
    batch_size: int = 16,
    max_new_tokens: int = 24,
) -> dict:
    """Play ``rows`` (QA rows: ``question``, ``golden_answers``) with no retrieval (``retriever`` None) or one search;
    return ``{"records": [...], "metrics": {...}}`` (EM, F1, tokens per question, searches per question)."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    records = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        passages = retriever.search([r["question"] for r in batch], topk) if retriever else [None] * len(batch)
        prompts = [
            tokenizer.apply_chat_template(
                baseline_messages(r["question"], p), add_generation_prompt=True, tokenize=False
            )
            for r, p in zip(batch, passages, strict=True)
        ]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        width = encoded["input_ids"].shape[1]
        for i, row in enumerate(batch):
            reply_ids = [t for t in out[i, width:].tolist() if t != tokenizer.pad_token_id]
            reply = tokenizer.decode(reply_ids, skip_special_tokens=True)
            answer = first_line(reply)
            prompt_tokens = int(encoded["attention_mask"][i].sum())
            records.append(
                {
                    "id": row.get("id"),
                    "answer": answer,
                    "em": exact_match(answer, row["golden_answers"]),
                    "f1": f1_score(answer, row["golden_answers"]),
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + len(reply_ids),
                    "passage_ids": [p.id for p in passages[i]] if passages[i] else [],
                }
            )
    n = max(len(records), 1)
    metrics = {
        "num_questions": len(records),
        "em": sum(r["em"] for r in records) / n,
        "f1": sum(r["f1"] for r in records) / n,
        "searches_per_question": 1.0 if retriever else 0.0,
        "total_tokens_per_question": sum(r["total_tokens"] for r in records) / n,
        "peak_context_tokens": sum(r["prompt_tokens"] for r in records) / n,
    }
    return {"records": records, "metrics": metrics}
