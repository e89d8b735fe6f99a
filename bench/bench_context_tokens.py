"""Context tokens per round, MemPO memory context vs the full-history (Search-R1) context, on the demo world.

A scripted policy plays every demo test question for exactly `--rounds` rounds through the real `RolloutEngine`
and BM25 retriever (via `mempo_trl.evaluation.evaluate`, which does the token accounting): each turn is
``<mem> summary </mem> <think> ... </think>`` then a ``<search>`` (the question's hop queries, in turn) in rounds
1..N-1 and the gold ``<answer>`` in round N. The summary is the question plus the titles and first sentences of the
passages retrieved so far, kept to at most `--mem-tokens` tokens (the most recent notes win). Both context modes
get the same scripted turns and the same retrieved passages; only the context differs.

Two workloads: the demo passages as shipped (one or two sentences each) and wiki-length passages (the same passages
padded to about `--wiki-words` words with seeded filler sentences about their subject, like the ~100-word chunks of
wiki-18 that Search-R1 and the paper retrieve top-3 from).

    python bench/bench_context_tokens.py                      # tiny tokenizer, 8 rounds, mem <= 128 tokens
    python bench/bench_context_tokens.py --tokenizer DIR      # any local tokenizer with a chat template
"""

import argparse
import json
import random
import re
import tempfile
from collections import defaultdict
from pathlib import Path

from mempo_trl.agent import MemPOAgent, load_chat_tokenizer
from mempo_trl.data import load_qa
from mempo_trl.evaluation import compare_modes, evaluate
from mempo_trl.kit.demo_world import demo_paths
from mempo_trl.protocol import TurnProtocol
from mempo_trl.retrieval import BM25Retriever


_QUESTION = re.compile(r"Question: (.*?)<\|im_end\|>", re.DOTALL)
_DOC = re.compile(r"Doc \d+\(Title: (.*?)\) ([^.\n]*\.?)")
THINK = "I should check the retrieved passages before answering."
_FILLER = (
    "{t} is described in several regional chronicles of the period.",
    "Records about {t} were collected by local historians over many years.",
    "Travellers who visited the area often wrote about {t} in their letters.",
    "A museum exhibition once presented documents and maps related to {t}.",
    "The name {t} appears in old registers, newspapers and trade directories.",
    "Later accounts of {t} repeat the same facts with small differences.",
    "Scholars still discuss how the early history of {t} should be read.",
    "Photographs of {t} from the last century are kept in a public archive.",
)


def wiki_length_corpus(passages: list[dict], words: int, seed: int = 0) -> list[dict]:
    """The passages padded to at least `words` words with seeded filler sentences about their title."""
    rng = random.Random(seed)
    padded = []
    for passage in passages:
        title, text = passage["contents"].split("\n", 1)
        while len(text.split()) < words:
            text += " " + rng.choice(_FILLER).format(t=title.strip('"'))
        padded.append({"id": passage["id"], "contents": f"{title}\n{text}"})
    return padded


class ScriptedAgent:
    """`GenerateFn` that plays the scripted turns; it recognises each question in the prompt and counts its rounds."""

    def __init__(self, tokenizer, rows: list[dict], rounds: int, mem_tokens: int):
        self.tokenizer = tokenizer
        self.rows = {row["question"]: row for row in rows}
        self.rounds = rounds
        self.mem_tokens = mem_tokens
        self.played = defaultdict(int)
        self.notes = defaultdict(list)

    def _memory(self, question: str) -> str:
        head = f"Question: {question} Notes:"
        budget = self.mem_tokens - len(self.tokenizer(head, add_special_tokens=False).input_ids)
        notes = self.tokenizer(" " + " ".join(self.notes[question]), add_special_tokens=False).input_ids
        return head + (self.tokenizer.decode(notes[-budget:]) if budget > 0 and self.notes[question] else "")

    def __call__(self, prompts: list[list[int]]):
        completions = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            question = _QUESTION.search(text).group(1)
            row = self.rows[question]
            info = text.rsplit("<information>", 1)[1].split("</information>")[0] if self.played[question] else ""
            self.notes[question] += [f"{title}: {first}" for title, first in _DOC.findall(info)]
            self.played[question] += 1
            if self.played[question] < self.rounds:
                queries = row["hop_queries"]
                action = f"<search> {queries[(self.played[question] - 1) % len(queries)]} </search>"
            else:
                action = f"<answer> {row['golden_answers'][0]} </answer>"
            turn = f"<mem> {self._memory(question)} </mem>\n<think> {THINK} </think>\n{action}"
            completions.append(self.tokenizer(turn, add_special_tokens=False).input_ids)
        return completions, None


def run_workload(tokenizer, rows: list[dict], corpus: str, args) -> dict:
    """Play the scripted agent in both context modes over `corpus`; return the overall metrics and the comparison."""
    retriever = BM25Retriever.from_corpus(corpus)
    results = {}
    for mode in ("memory", "full_history"):
        script = ScriptedAgent(tokenizer, rows, args.rounds, args.mem_tokens)
        agent = MemPOAgent(tokenizer, retriever, script, TurnProtocol(max_turns=args.rounds, retrieval_topk=args.topk))
        results[mode] = evaluate(agent, rows, context_mode=mode, progress=False)
    memory, full = results["memory"].metrics["overall"], results["full_history"].metrics["overall"]
    assert memory["em"] == full["em"] == 1.0 and memory["turns_per_question"] == args.rounds
    return {"memory": memory, "full_history": full, **compare_modes(results["memory"], results["full_history"])}


def print_workload(name: str, result: dict, args) -> None:
    memory, full = result["memory"], result["full_history"]
    print(f"\n{name}")
    print("| round | memory prompt tokens | full-history prompt tokens |")
    print("|---:|---:|---:|")
    for k, (m, f) in enumerate(zip(memory["prompt_tokens_per_round"], full["prompt_tokens_per_round"]), 1):
        print(f"| {k} | {m:.1f} | {f:.1f} |")
    print(
        f"| total per question | {memory['total_tokens_per_question']:.1f} | {full['total_tokens_per_question']:.1f} |"
    )
    print(f"| peak context | {memory['peak_context_tokens']:.1f} | {full['peak_context_tokens']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: build the tiny model)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--mem-tokens", type=int, default=128, help="upper bound of the <mem> summary, in tokens")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--wiki-words", type=int, default=100, help="words per passage of the wiki-length workload")
    args = parser.parse_args()

    if args.tokenizer is None:
        from mempo_trl.kit.tiny import build_tiny_model

        tokenizer = load_chat_tokenizer(str(build_tiny_model(tempfile.mkdtemp(), seed=0)))
    else:
        tokenizer = load_chat_tokenizer(args.tokenizer)
    paths = demo_paths()
    rows = list(load_qa(paths.test))
    wiki = Path(tempfile.mkdtemp()) / "wiki_length_corpus.jsonl"
    passages = [json.loads(line) for line in paths.corpus.read_text(encoding="utf-8").splitlines()]
    wiki.write_text("".join(json.dumps(p) + "\n" for p in wiki_length_corpus(passages, args.wiki_words)))
    workloads = {
        "demo passages": run_workload(tokenizer, rows, str(paths.corpus), args),
        f"wiki-length passages (~{args.wiki_words} words)": run_workload(tokenizer, rows, str(wiki), args),
    }
    print(
        f"{len(rows)} demo test questions, {args.rounds} rounds, top-{args.topk} BM25, mem <= {args.mem_tokens} tokens"
    )
    for name, result in workloads.items():
        print_workload(name, result, args)
    print()
    for name, result in workloads.items():
        print(
            f"{name}: total-token reduction at {args.rounds} rounds {result['total_token_reduction_pct']:.2f}%, "
            f"peak-context reduction {result['peak_context_reduction_pct']:.2f}%"
        )


if __name__ == "__main__":
    main()
