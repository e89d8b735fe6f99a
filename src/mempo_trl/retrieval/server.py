"""FastAPI server for any `Retriever`, speaking Search-R1's `POST /retrieve` API plus `GET /health`.

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers `{"result": [[{"document": {"id",
"contents"}, "score"}, ...], ...]}` (documents alone when `return_scores` is false), so Search-R1, verl and SkyRL
clients work unchanged. Searches run in FastAPI's thread pool, so one slow batch does not block `/health`.
"""

import logging
from typing import Any

from mempo_trl.retrieval.base import Retriever


try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, StrictBool, StrictInt, StrictStr
except ImportError as e:
    raise ImportError(f"The retrieval server needs fastapi and uvicorn: pip install 'mempo_trl[server]' ({e}).") from e


logger = logging.getLogger(__name__)

EXAMPLE_REQUEST = '{"queries": ["who wrote hamlet"], "topk": 3, "return_scores": true}'


class RetrieveRequest(BaseModel):
    queries: list[StrictStr]
    topk: StrictInt = 3
    return_scores: StrictBool = False


def create_app(retriever: Retriever, max_queries: int = 4096, max_topk: int = 100) -> FastAPI:
    """Wrap `retriever` in the `/retrieve` + `/health` API; bad requests get HTTP 422 with an `error` message.

    Example:
        >>> from fastapi.testclient import TestClient
        >>> client = TestClient(create_app(BM25Retriever.from_corpus("corpus.jsonl")))
        >>> client.post("/retrieve", json={"queries": [], "topk": 3}).json()["error"]
        'queries must not be empty; send 1 to 4096 queries per request.'
    """
    app = FastAPI(title="mempo_trl retriever", summary="Search-R1 compatible /retrieve API.")

    @app.exception_handler(RequestValidationError)
    async def readable_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(_describe(error) for error in exc.errors())
        return _invalid(f"invalid request body: {problems}. Expected JSON like {EXAMPLE_REQUEST}.")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "num_passages": getattr(retriever, "num_passages", None),
            "retriever": getattr(retriever, "name", type(retriever).__name__),
            "max_queries": max_queries,
            "max_topk": max_topk,
        }

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> JSONResponse:
        if not request.queries:
            return _invalid(f"queries must not be empty; send 1 to {max_queries} queries per request.")
        if len(request.queries) > max_queries:
            return _invalid(
                f"too many queries ({len(request.queries)}); this server accepts at most {max_queries} per "
                "request. Split the batch or restart the server with a larger --max-queries."
            )
        if not 1 <= request.topk <= max_topk:
            return _invalid(f"topk must be between 1 and {max_topk}, got {request.topk}.")
        try:
            hits = retriever.search(request.queries, request.topk)
        except Exception as e:
            logger.exception("search failed for %d queries", len(request.queries))
            return JSONResponse({"error": f"the retriever failed: {type(e).__name__}: {e}"}, status_code=500)
        if request.return_scores:
            result = [
                [{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in passages]
                for passages in hits
            ]
        else:
            result = [[{"id": p.id, "contents": p.contents} for p in passages] for passages in hits]
        return JSONResponse({"result": result})

    return app


def serve(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queries: int = 4096,
    max_topk: int = 100,
    log_level: str = "info",
) -> None:
    """Serve `retriever` with uvicorn until interrupted (access log off: it costs latency under load).

    Example:
        >>> serve(BM25Retriever.from_corpus("corpus.jsonl"), port=8000)  # then HttpRetriever("http://127.0.0.1:8000")
    """
    app = create_app(retriever, max_queries=max_queries, max_topk=max_topk)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def _invalid(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=422)


def _describe(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        return (
            f"the body is not valid JSON ({error['ctx'].get('error', 'decode error')} at character {error['loc'][-1]})"
        )
    location = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
    return f"{location}: {error['msg']}"
