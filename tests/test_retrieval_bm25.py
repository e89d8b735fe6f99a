"""BM25Retriever: rankings on a small corpus, edge-case queries, save/load, the on-disk cache, load_retriever.

Run: pytest tests/test_retrieval_bm25.py
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import bm25s
import pytest
from datasets import Dataset

import mempo_trl
from mempo_trl.retrieval import BM25Retriever, HttpRetriever, Retriever, load_retriever


CORPUS = [
    ("1", "Hamlet", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    ("2", "Paris", "Paris is the capital and largest city of France."),
    ("3", "Elsinore", "Elsinore is the castle in Denmark where Hamlet is set."),
    ("4", "Marie Curie", "Marie Curie won two Nobel Prizes, in physics and in chemistry."),
    ("5", "Lyon", "Lyon is a large city in France, known for its cuisine."),
]
DEMO_CORPUS = Path(mempo_trl.__file__).parent / "kit" / "demo" / "corpus.jsonl"


def write_corpus(path, rows=CORPUS):
    with path.open("w", encoding="utf-8") as f:
        for pid, title, text in rows:
            f.write(json.dumps({"id": pid, "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


@pytest.fixture
def retriever(corpus, tmp_path):
    return BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache")


def ids(results):
    return [[p.id for p in hits] for hits in results]


def test_rankings_batched_in_query_order(retriever):
    queries = ["Who won Nobel prizes in chemistry?", "capital of France", "hamlet"]
    results = retriever.search(queries, topk=5)
    assert ids(results) == [["4"], ["2", "5"], ["1", "3"]]
    for hits in results:
        scores = [p.score for p in hits]
        assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    assert results[1][0].title == "Paris" and results[1][0].text == CORPUS[1][2]
    assert results[1][0].contents == '"Paris"\nParis is the capital and largest city of France.'
    assert isinstance(retriever, Retriever) and retriever.num_passages == 5


def test_topk_cuts_and_may_exceed_corpus(retriever):
    assert ids(retriever.search(["hamlet"], topk=1)) == [["1"]]
    assert ids(retriever.search(["is"], topk=1000)) == [[]]  # stopword only
    assert len(retriever.search(["city france castle hamlet curie"], topk=1000)[0]) == 5


def test_queries_without_matches_get_empty_lists(retriever):
    assert retriever.search(["", "   ", "the of and", "zebra quagga", "paris"], topk=3)[:4] == [[], [], [], []]
    assert retriever.search([], topk=3) == []


def test_invalid_arguments(retriever):
    with pytest.raises(ValueError, match="topk must be >= 1"):
        retriever.search(["paris"], topk=0)
    with pytest.raises(TypeError, match="list of strings"):
        retriever.search("paris", topk=1)
    with pytest.raises(ValueError, match="unknown stemmer 'klingon'"):
        BM25Retriever.from_corpus("unused.jsonl", stemmer="klingon")


def test_stemmer_option(corpus, tmp_path):
    stemmed = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "c")
    plain = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "c", stemmer=None)
    assert ids(stemmed.search(["castles"], topk=3)) == [["3"]]
    assert ids(plain.search(["castles"], topk=3)) == [[]]


def test_dataset_source_matches_file(retriever):
    dataset = Dataset.from_dict(
        {"id": [r[0] for r in CORPUS], "title": [r[1] for r in CORPUS], "text": [r[2] for r in CORPUS]}
    )
    from_dataset = BM25Retriever.from_corpus(dataset, cache_dir=retriever.cache_path.parent)
    assert from_dataset.cache_hit and from_dataset.cache_path == retriever.cache_path
    assert from_dataset.search(["capital of France"], 3) == retriever.search(["capital of France"], 3)


def test_save_load_round_trip(retriever, tmp_path):
    retriever.save(tmp_path / "saved")
    loaded = BM25Retriever.load(tmp_path / "saved")
    queries = ["hamlet castle", "France city", "Nobel physics", "nothing here"]
    assert loaded.search(queries, topk=4) == retriever.search(queries, topk=4)
    assert loaded.passages == retriever.passages and loaded.params == retriever.params
    assert load_retriever(str(tmp_path / "saved")).search(queries, 4) == retriever.search(queries, 4)


def test_load_rejects_other_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a saved BM25 index"):
        BM25Retriever.load(tmp_path)


def test_load_rejects_other_format(retriever, tmp_path):
    retriever.save(tmp_path / "saved")
    meta = tmp_path / "saved" / "mempo_bm25.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 99}))
    with pytest.raises(ValueError, match="format 99.*Rebuild"):
        BM25Retriever.load(tmp_path / "saved")


def test_cache_hit_does_not_rebuild(corpus, tmp_path, monkeypatch):
    first = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache")
    assert not first.cache_hit and first.cache_path.parent == tmp_path / "cache"

    def no_indexing(*args, **kwargs):
        raise AssertionError("the index was rebuilt despite a cache entry")

    monkeypatch.setattr(bm25s.BM25, "index", no_indexing)
    second = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache")
    assert second.cache_hit and second.cache_path == first.cache_path
    assert second.search(["hamlet", "france"], 5) == first.search(["hamlet", "france"], 5)


def test_cache_key_covers_corpus_and_params(corpus, tmp_path):
    base = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache")
    for kwargs in ({"k1": 1.2}, {"b": 0.5}, {"stemmer": None}):
        other = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache", **kwargs)
        assert not other.cache_hit and other.cache_path != base.cache_path
    edited = write_corpus(tmp_path / "edited.jsonl", CORPUS[:-1] + [("5", "Lyon", "Lyon is in France.")])
    assert not BM25Retriever.from_corpus(edited, cache_dir=tmp_path / "cache").cache_hit
    assert BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache", k1=1.2).cache_hit


def test_default_cache_dir_from_env(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPO_CACHE", str(tmp_path / "root"))
    assert BM25Retriever.from_corpus(corpus).cache_path.parent == tmp_path / "root" / "bm25"


def test_broken_cache_entry_is_rebuilt(corpus, tmp_path, caplog):
    entry = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache").cache_path
    (entry / "data.csc.index.npy").unlink()
    with caplog.at_level(logging.WARNING):
        rebuilt = BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache")
    assert not rebuilt.cache_hit and "Rebuilding the unreadable BM25 cache entry" in caplog.text
    assert BM25Retriever.from_corpus(corpus, cache_dir=tmp_path / "cache").cache_hit


def test_unwritable_cache_still_serves(corpus, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        retriever = BM25Retriever.from_corpus(corpus, cache_dir=blocker / "cache")
    assert retriever.cache_path is None and "continuing without it" in caplog.text
    assert ids(retriever.search(["hamlet"], 1)) == [["1"]]


def test_load_retriever_dispatch(corpus, tmp_path):
    by_path = load_retriever(str(corpus), cache_dir=tmp_path / "cache")
    by_prefix = load_retriever(f"bm25:{corpus}", cache_dir=tmp_path / "cache", stemmer=None)
    assert isinstance(by_path, BM25Retriever) and by_path.params["stemmer"] == "english"
    assert isinstance(by_prefix, BM25Retriever) and by_prefix.params["stemmer"] is None
    http = load_retriever("http://127.0.0.1:9/retrieve", timeout=1.0)
    assert isinstance(http, HttpRetriever) and http.base_url == "http://127.0.0.1:9" and http.timeout == 1.0
    with pytest.raises(ValueError, match="cannot tell which retriever"):
        load_retriever("corpus.parquet")
    with pytest.raises(ValueError, match="cannot tell which retriever"):
        load_retriever("dense:only-a-model")  # dense retrievers come from typed settings (`build_retriever`)


def test_demo_hop_queries_find_their_gold_passage_in_top3(tmp_path):
    retriever = BM25Retriever.from_corpus(DEMO_CORPUS, cache_dir=tmp_path / "cache")
    rows = [json.loads(line) for line in (DEMO_CORPUS.parent / "test.jsonl").read_text().splitlines()]
    hops = [
        (query, gold) for row in rows for query, gold in zip(row["hop_queries"], row["supporting_ids"], strict=True)
    ]
    results = retriever.search([query for query, _ in hops], topk=3)
    misses = [(query, gold) for (query, gold), hits in zip(hops, results) if gold not in [p.id for p in hits]]
    assert len(hops) > 0 and misses == []


# A stand-in `jax` that records what is done with it: bm25s imports `jax.lax` and calls `top_k` at import time, which
# with a real JAX starts its GPU client and preallocates 75% of every GPU.
FAKE_JAX = {
    "jax/__init__.py": "import os\nopen(os.environ['FAKE_JAX_LOG'], 'a').write('import jax\\n')\n",
    "jax/lax.py": (
        "import os\n"
        "def top_k(x, k):\n"
        "    open(os.environ['FAKE_JAX_LOG'], 'a').write('top_k\\n')\n"
        "    raise RuntimeError('JAX started')\n"
    ),
}


def _run_with_fake_jax(tmp_path, code: str) -> tuple[str, str]:
    """Run ``code`` in a fresh interpreter whose ``jax`` is the stand-in; return (stdout, what jax recorded)."""
    for name, text in FAKE_JAX.items():
        (tmp_path / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / name).write_text(text)
    log = tmp_path / "jax.log"
    env = {
        **os.environ,
        "FAKE_JAX_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), *sys.path]),
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, log.read_text() if log.exists() else ""


def test_building_and_querying_never_starts_jax(tmp_path):
    code = (
        "import sys\n"
        "from mempo_trl.retrieval import BM25Retriever\n"
        f"r = BM25Retriever.from_corpus({str(DEMO_CORPUS)!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
        "hits = r.search(['where did Dethbre Leinhenmor die'], topk=3)[0]\n"
        "import bm25s\n"
        "print(len(hits), 'jax' in sys.modules, bm25s.selection.JAX_IS_AVAILABLE)\n"
    )
    stdout, jax_log = _run_with_fake_jax(tmp_path, code)
    assert stdout.split() == ["3", "False", "False"]
    assert jax_log == ""  # never imported, let alone started


def test_a_jax_the_caller_imported_is_left_alone_and_not_started(tmp_path):
    code = (
        "import sys, jax, jax.lax\n"
        "before = sys.modules['jax'], sys.modules['jax.lax']\n"
        "from mempo_trl.retrieval import BM25Retriever\n"
        f"BM25Retriever.from_corpus({str(DEMO_CORPUS)!r}, cache_dir={str(tmp_path / 'cache')!r}).search(['x'], 1)\n"
        "print((sys.modules['jax'], sys.modules['jax.lax']) == before)\n"
    )
    stdout, jax_log = _run_with_fake_jax(tmp_path, code)
    assert stdout.split() == ["True"]
    assert jax_log == "import jax\n"  # the caller's import only: no top_k


def test_bm25s_imported_first_with_jax_warns_how_to_fix(tmp_path):
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "import jax.lax\n"
        "jax.lax.top_k = lambda x, k: (x, k)  # a JAX that starts\n"
        "import bm25s\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import mempo_trl.retrieval\n"
        "print([str(w.message) for w in caught])\n"
    )
    stdout, _ = _run_with_fake_jax(tmp_path, code)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in stdout and "import mempo_trl before bm25s" in stdout
