"""Smoke tests of the benches in `bench/`: each bench's core function runs at the smallest size on the tiny model.

Nothing here is timed: the benches print their timings, these tests only check that they run, that the memory-scoring
bench's two schemes give the same P values (and the shared-prefix one forwards fewer tokens), and that the
training-step bench played the same rounds with both trainers.
"""

import importlib

import pytest
import torch


def _load(name: str):
    """A bench of `bench/` (on pytest's ``pythonpath``) by its module name."""
    return importlib.import_module(name)


@pytest.fixture
def one_thread():
    """One intra-op thread: HF generation with several threads crawls on a loaded CPU (OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_scripted_policy_turns_have_the_exact_length(tiny_model_dir):
    bench = _load("bench_memory_scoring")
    _, tokenizer = bench.build_model(tiny_model_dir)
    rows = bench.demo_rows(1)
    prompt = "<|im_start|>user\nQuestion: " + rows[0]["question"] + "<|im_end|>\n<|im_start|>assistant\n"
    for style in ("mempo", "tool_call"):
        policy = bench.ScriptedPolicy(tokenizer, rows, rounds=2, turn_tokens=64, mem_tokens=32, style=style)
        first = policy.turn(prompt)
        assert len(first) == 64
        text = tokenizer.decode(first, skip_special_tokens=False)
        assert ("<search>" in text) if style == "mempo" else ("<tool_call>" in text)
        second = policy.turn(prompt + text + "<information>Doc 1(Title: T) x.</information>")
        assert len(second) == 64
        assert f"<answer> {rows[0]['golden_answers'][0]} </answer>" in tokenizer.decode(second)
    with pytest.raises(ValueError, match="turn_tokens"):
        bench.ScriptedPolicy(tokenizer, rows, rounds=2, turn_tokens=8).turn(prompt)


def test_memory_scoring_bench_schemes_agree(tiny_model_dir, one_thread):
    bench = _load("bench_memory_scoring")
    results = bench.run(rounds_list=(2, 3), trajectories=2, batch_size=4, repeats=1, model_dir=tiny_model_dir)
    assert [r["rounds"] for r in results] == [2, 3]
    for r in results:
        assert r["items"] == 2 * (r["rounds"] - 1)
        assert (r["p_naive"] > 0).all()
        torch.testing.assert_close(r["p_shared"], r["p_naive"], rtol=1e-4, atol=1e-7)
        assert r["max_abs_logp_diff"] < 1e-4
        assert r["shared_rows"] == 2  # one sequence per trajectory
        assert r["naive_forwards"] >= 1 and r["shared_forwards"] == 2  # the prefixes, then the answer blocks
    three = results[1]
    assert three["shared_real_tokens"] < three["naive_real_tokens"]
    bench.print_table(results)


def test_train_step_bench_runs_both_trainers(tiny_model_dir, one_thread):
    bench = _load("bench_train_step")
    kinds = ("stock", "batched", "shared_prefix", "shared_prefix_loss")
    results = bench.run(
        rounds_list=(2,), trajectories=2, num_generations=2, steps=1, kinds=kinds, model_dir=tiny_model_dir
    )
    assert [r["kind"] for r in results] == list(kinds)
    for r in results:
        assert r["rounds"] == 2 and len(r["steps"]) == 1
        assert r["step"] > 0 and r["generation"] > 0 and r["loss_fwd_bwd"] > 0
        assert r["generation"] + r["retrieval"] + r["memory_scoring"] <= r["step"]
        assert r["flops"] is None  # counted in a warm-up step only
    stock, batched, shared, shared_loss = results
    assert stock["memory_scoring"] == 0.0 and batched["memory_scoring"] > 0 and shared["memory_scoring"] > 0
    assert batched["loss_rows"] == shared["loss_rows"] == shared_loss["loss_rows"] == 2 * 2  # one row per round
    assert stock["loss_rows"] == 2  # one full-history row per trajectory
    # the padded loss forwards its whole batch; the shared-prefix loss forwards each question's prefix once
    assert (
        stock["loss_forwarded_tokens"] == stock["loss_tokens"]
        and shared["loss_forwarded_tokens"] == shared["loss_tokens"]
    )
    assert shared_loss["loss_forwarded_tokens"] < 0.9 * shared["loss_tokens"]
    assert [row["trainer"] for row in bench.ratios(results)] == [bench.KINDS[k] for k in kinds[1:]]
    bench.print_tables(results)


def test_train_step_bench_isolated_counts_flops_and_memory(tiny_model_dir, tmp_path, one_thread, capsys):
    """A configuration in its own process (its peak RSS), FLOPs counted in the warm-up step, and the tables of two
    saved reports merged."""
    bench = _load("bench_train_step")
    kinds = ("stock", "shared_prefix")
    results = bench.run(
        rounds_list=(2,),
        trajectories=2,
        num_generations=2,
        steps=1,
        warmup_steps=1,
        kinds=kinds,
        model_dir=tiny_model_dir,
        count_flops=True,
        isolate=True,
    )
    for r in results:
        assert r["peak_rss_mib"] >= r["base_rss_mib"] > 0 and r["flops"] > 1e9
    ratio = bench.ratios(results)[0]
    assert ratio["flops"] == results[1]["flops"] / results[0]["flops"] and 0 < ratio["peak_rss"]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, result in zip(paths, results):
        bench.write_json(str(path), [result], ["--rounds", "2"], 1.0)
    bench.main(["--merge", *map(str, paths), "--json", str(tmp_path / "merged.json")])
    assert "| 2 | 2 | MemPO, shared_prefix |" in capsys.readouterr().out


def test_wiki_length_corpus_pads_every_passage_and_keeps_its_text():
    bench = _load("bench_context_tokens")
    passages = [{"id": "0", "contents": '"Sedo"\nSedo is a city.'}, {"id": "1", "contents": '"Rum"\n' + "w " * 120}]
    padded = bench.wiki_length_corpus(passages, words=100)
    assert [p["id"] for p in padded] == ["0", "1"]
    title, text = padded[0]["contents"].split("\n", 1)
    assert title == '"Sedo"' and text.startswith("Sedo is a city. ") and 100 <= len(text.split()) < 120
    assert "Sedo" in text[16:]  # the filler is about the passage's subject
    assert padded[1] == passages[1] and bench.wiki_length_corpus(passages, words=100) == padded


def test_turn_boundaries_bench(qwen_model_dir):
    result = _load("bench_turn_boundaries").run(
        str(qwen_model_dir), questions=2, chatter="glued", max_completion_length=96
    )
    assert result["valid_turn_rate"] == 1.0 and result["episodes_valid"] == 1.0
    assert result["generated_tokens_per_turn"] == result["kept_tokens_per_turn"]


def test_qwen2_5_shapes_have_the_released_sizes():
    """Parameter counts of the released Qwen2.5 models (494,032,768 / 1,543,714,304 / 3,085,938,688 / 7,615,616,512),
    built on the meta device."""
    from mempo_trl.kit.qwen import build_qwen2_5_tokenizer

    bench = _load("bench_train_step")
    tokenizer = build_qwen2_5_tokenizer()
    sizes = {
        shape: sum(p.numel() for p in bench.qwen2_5_shaped(shape, tokenizer, "meta").parameters())
        for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
    }
    assert sizes == {
        "qwen2.5-0.5b": 494_032_768,
        "qwen2.5-1.5b": 1_543_714_304,
        "qwen2.5-3b": 3_085_938_688,
        "qwen2.5-7b": 7_615_616_512,
    }


def test_train_step_bench_realistic_batch_options(tiny_model_dir, one_thread):
    """The realistic-batch workload's options at the smallest size: warm-up steps reported apart, wiki-length
    passages, gradient accumulation and activation checkpointing."""
    bench = _load("bench_train_step")
    results = bench.run(
        rounds_list=(2,),
        trajectories=4,
        num_generations=2,
        steps=1,
        warmup_steps=1,
        kinds=("stock", "shared_prefix"),
        model_dir=tiny_model_dir,
        passage_words=100,
        grad_accum=2,
        activation_checkpointing=True,
    )
    for r in results:
        assert len(r["warmup_steps"]) == 1 and len(r["steps"]) == 1 and r["step"] == r["steps"][0]
    stock, shared = results
    assert shared["loss_rows"] == 4 * 2 and stock["loss_rows"] == 4
    # wiki-length passages: MemPO's round-2 prompts hold three ~100-word passages
    assert shared["prefill_tokens"] > 4 * 3 * 100
    bench.print_tables(results)


def test_the_viewer_bench_writes_distinct_synthetic_episodes_that_make_a_page(tmp_path):
    from mempo_trl.viewer import load_episodes, page_data

    bench = _load("bench_viewer")
    information = "<information>Doc 1(Title: Ada) Ada was born in Ulm.</information>"
    rounds = [{"prompt_tokens": 9, "mem": "m", "information": information}, {"prompt_tokens": 20, "mem": None}]
    real = [{"question": "Where?", "golden_answers": ["Ulm"], "em": 1.0, "rounds": rounds}]
    bench.synthetic_log(real, tmp_path / "rollouts", episodes=200)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step-000001.jsonl", "step-000002.jsonl"]
    data = page_data(load_episodes(tmp_path), "bench")
    assert len(data["episodes"]) == 200 and len(data["passages"]) == 200
    assert len({e["question"] for e in data["episodes"]}) == 200 and data["episodes"][7]["rounds"][0]["gold"]
