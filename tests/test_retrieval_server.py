"""The FastAPI app in-process (TestClient): response shapes, /health, and a readable 422 for every bad request.

Run: pytest tests/test_retrieval_server.py
"""

import pytest
from fastapi.testclient import TestClient

from mempo_trl.retrieval import Passage, create_app


class TitleEcho:
    """Answers each query with `topk` passages titled after it; fails on the query "boom"."""

    name = "echo"
    num_passages = 7

    def search(self, queries, topk):
        if "boom" in queries:
            raise RuntimeError("index file vanished")
        return [
            [Passage(id=f"{q}-{i}", title=q, text=f"hit {i}", score=1.0 / (i + 1)) for i in range(topk)]
            for q in queries
        ]


@pytest.fixture
def client():
    return TestClient(create_app(TitleEcho(), max_queries=4, max_topk=5))


def test_scored_and_unscored_shapes(client):
    scored = client.post("/retrieve", json={"queries": ["a", "b"], "topk": 2, "return_scores": True})
    assert scored.status_code == 200
    assert scored.json()["result"][1] == [
        {"document": {"id": "b-0", "contents": '"b"\nhit 0'}, "score": 1.0},
        {"document": {"id": "b-1", "contents": '"b"\nhit 1'}, "score": 0.5},
    ]
    plain = client.post("/retrieve", json={"queries": ["a"], "topk": 1})
    assert plain.json() == {"result": [[{"id": "a-0", "contents": '"a"\nhit 0'}]]}


def test_topk_defaults_to_three_like_search_r1(client):
    assert len(client.post("/retrieve", json={"queries": ["a"]}).json()["result"][0]) == 3


def test_health(client):
    assert client.get("/health").json() == {
        "status": "ok",
        "num_passages": 7,
        "retriever": "echo",
        "max_queries": 4,
        "max_topk": 5,
        "max_body_bytes": 4 * 2**20,
        "max_response_bytes": 64 * 2**20,
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"queries": [], "topk": 1}, "queries must not be empty; send 1 to 4 queries"),
        ({"queries": ["q"] * 5, "topk": 1}, "too many queries (5); this server accepts at most 4"),
        ({"queries": ["q"], "topk": 0}, "topk must be between 1 and 5, got 0"),
        ({"queries": ["q"], "topk": 6}, "topk must be between 1 and 5, got 6"),
        ({"queries": ["q", 3], "topk": 1}, "queries.1: Input should be a valid string"),
        ({"queries": "q", "topk": 1}, "queries: Input should be a valid list"),
        ({"queries": ["q"], "topk": "2"}, "topk: Input should be a valid integer"),
        ({"topk": 1}, "queries: Field required"),
        (["q"], "Input should be a valid dictionary"),
    ],
)
def test_bad_requests_get_422_with_a_message(client, body, message):
    response = client.post("/retrieve", json=body)
    assert response.status_code == 422
    assert message in response.json()["error"]


def test_invalid_json_body(client):
    response = client.post("/retrieve", content=b'{"queries": ["a"', headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert "the body is not valid JSON" in response.json()["error"]
    assert '{"queries": ["who wrote hamlet"], "topk": 3' in response.json()["error"]


def test_retriever_failure_is_a_500_with_the_cause(client):
    response = client.post("/retrieve", json={"queries": ["boom"], "topk": 1})
    assert response.status_code == 500
    assert response.json() == {"error": "the retriever failed: RuntimeError: index file vanished"}
