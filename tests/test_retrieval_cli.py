"""`mempo-trl build-index` through the real entry point's parser (serve-retriever runs in test_retrieval_http.py).

Run: pytest tests/test_retrieval_cli.py
"""

import doctest
import json

import mempo_trl.retrieval.settings as settings
from mempo_trl.cli import main


def test_doctests():
    assert doctest.testmod(settings).failed == 0


def test_build_index_then_cache_hit(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Ulm"\nUlm is a city on the Danube.'}) + "\n")
    args = ["build-index", "--corpus", str(corpus), "--retriever_cache_dir", str(tmp_path / "cache")]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "bm25 index of 1 passages built in" in first and str(tmp_path / "cache") in first
    assert main([*args, "--bm25_k1", "1.5"]) == 0
    second = capsys.readouterr().out
    assert "loaded from cache" in second and first.split("cache: ")[1] == second.split("cache: ")[1]


def test_build_index_reports_bad_input(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1"}\n')
    assert main(["build-index", "--corpus", str(corpus), "--retriever_cache_dir", str(tmp_path)]) == 2
    assert f"error: {corpus}, line 1: missing field 'contents'" in capsys.readouterr().err
    assert main(["build-index", "--corpus", str(corpus), "--retriever_type", "dense"]) == 2
    assert "retriever_type dense needs retriever_model" in capsys.readouterr().err
    assert main(["build-index", "--retriever_url", "http://127.0.0.1:1"]) == 2
    assert "build-index indexes a corpus: pass --corpus" in capsys.readouterr().err
