"""Turn boundaries under Qwen2.5's real tokenizer: a scripted model that keeps talking after its action.

A random Qwen2.5-shaped model (`mempo-trl kit build-qwen-model`) is scripted to write the oracle turns of demo
questions and then go on after the action tag (a hallucinated ``<information>`` block, glued to the tag or after a
newline), through the trainer's real HF generation path (`MemPOTrainer._generate_turns`, TRL's
`_generate_single_turn`) and the rollout engine. Prints the valid-turn rate, the episodes that end valid, and the
tokens generated and kept per turn. Runs against whatever `mempo_trl` is on the path (so the same script measures
an older checkout side by side):

    python bench/bench_turn_boundaries.py --model qwen-random --questions 24
"""

import argparse
import json
import statistics
import tempfile

import torch


CHATTER = {
    "glued": "<information>Doc 1(Title: made up) an invented passage about the question.</information>" * 8,
    "newline": "\n<information>Doc 1(Title: made up) an invented passage about the question.</information>" * 8,
}


def script_model(model, continuation_for, counter):
    """Greedy `generate` writes `continuation_for(prompt ids)` per row (then eos); counts decoding steps."""

    class FreeHead(torch.nn.Module):  # the script overwrites the logits: skip the 151,936-row LM head
        def forward(self, hidden):
            return hidden.new_zeros(*hidden.shape[:-1], model.config.vocab_size)

    model.lm_head = FreeHead()
    forward, state = model.forward, {}
    pad, eos = model.generation_config.pad_token_id, model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    def scripted(*args, input_ids=None, **kwargs):
        out = forward(*args, input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > 1:
            state["step"], state["scripts"] = (
                0,
                [continuation_for([t for t in r if t != pad]) for r in input_ids.tolist()],
            )
        n = state["step"]
        state["step"] += 1
        counter["steps"] += 1
        logits = torch.full_like(out.logits, -1e4)
        for i, script in enumerate(state["scripts"]):
            logits[i, -1, script[n] if n < len(script) else eos] = 1e4
        out.logits = logits
        return out

    model.forward = scripted
    return model


def run(model_dir: str, questions: int, chatter: str, max_completion_length: int) -> dict:
    from datasets import Dataset
    from transformers import Qwen2ForCausalLM

    from mempo_trl import MemPOConfig, MemPOTrainer
    from mempo_trl.data import read_jsonl
    from mempo_trl.kit.demo_world import demo_paths
    from mempo_trl.kit.warmstart import oracle_episode_turns
    from mempo_trl.loading import load_tokenizer
    from mempo_trl.retrieval import BM25Retriever

    paths = demo_paths()
    retriever = BM25Retriever.from_corpus(paths.corpus, cache_dir=tempfile.mkdtemp())
    rows = read_jsonl(paths.train)[:questions]
    oracle = {row["question"]: [text for text, _ in oracle_episode_turns(row, retriever)] for row in rows}
    tokenizer = load_tokenizer(model_dir)

    def continuation_for(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        question = next(q for q in oracle if q in text)
        turns = oracle[question]
        done = 1 + max((k for k, t in enumerate(turns) if t in text), default=-1)
        return tokenizer(turns[done] + CHATTER[chatter], add_special_tokens=False)["input_ids"]

    counter = {"steps": 0}
    model = script_model(Qwen2ForCausalLM.from_pretrained(model_dir), continuation_for, counter)
    args = MemPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=max_completion_length,
        max_turns=8,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
    )
    dataset = Dataset.from_list([{"question": r["question"], "golden_answers": r["golden_answers"]} for r in rows])
    trainer = MemPOTrainer(model, retriever, args=args, train_dataset=dataset, processing_class=tokenizer)
    eos = set(trainer.eos_token_ids)
    generated = []
    single_turn = trainer._generate_single_turn

    def recording(*a, **k):
        completions, logprobs = single_turn(*a, **k)
        for c in completions:
            n = len(c)
            while n and c[n - 1] in eos:
                n -= 1
            generated.append(n)
        return completions, logprobs

    trainer._generate_single_turn = recording
    episodes = trainer.rollout_engine.play(rows, trainer._generate_turns).episodes
    rounds = [r for ep in episodes for r in ep.rounds]
    return {
        "chatter": chatter,
        "turns": len(rounds),
        "valid_turn_rate": sum(r.turn.valid for r in rounds) / len(rounds),
        "episodes_valid": sum(ep.format_valid for ep in episodes) / len(episodes),
        "generated_tokens_per_turn": statistics.mean(generated),
        "kept_tokens_per_turn": statistics.mean(len(r.completion_ids) for r in rounds),
        "decoding_steps": counter["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen2.5-shaped model directory (kit build-qwen-model)")
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--max-completion-length", type=int, default=256)
    args = parser.parse_args()
    for chatter in CHATTER:
        print(json.dumps(run(args.model, args.questions, chatter, args.max_completion_length)))


if __name__ == "__main__":
    main()
