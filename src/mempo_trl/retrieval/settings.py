"""`RetrieverArguments`, the retriever settings every command and recipe shares, and `build_retriever`, which
builds the retriever they describe from the typed fields (defaults: the retriever classes' own); and the default
limits of the retrieval server (`mempo_trl.retrieval.server`, which needs the `server` extra to import)."""

from dataclasses import dataclass, field

from mempo_trl.retrieval.base import Retriever
from mempo_trl.retrieval.http_client import MAX_RETRIES, RETRY_BUDGET, TIMEOUT, check_retriever_url


MAX_QUERIES, MAX_TOPK = 4096, 100
"""Most queries per request and largest `topk` a server accepts by default."""
MAX_BODY_BYTES, MAX_RESPONSE_BYTES = 4 * 2**20, 64 * 2**20
"""Largest request body accepted and largest answer sent by default."""
REQUEST_TIMEOUT = 10.0
"""Seconds a connection has to send a whole request by default."""


@dataclass
class RetrieverArguments:
    """Where the agent's `<search>` goes: a Search-R1-style server, or a corpus indexed in process."""

    corpus: str | None = field(
        default=None, metadata={"help": "Passage corpus (JSONL `{id, contents}`) indexed in process."}
    )
    retriever_url: str | None = field(
        default=None,
        metadata={"help": "URL of a Search-R1-style retrieval server (`POST /retrieve`); overrides `corpus`."},
    )
    retriever_type: str = field(
        default="bm25",
        metadata={"help": "In-process index of `corpus`: `bm25` or `dense`.", "choices": ["bm25", "dense"]},
    )
    retriever_model: str | None = field(
        default=None, metadata={"help": "Local sentence-transformers model directory (`retriever_type: dense`)."}
    )
    retriever_cache_dir: str | None = field(
        default=None, metadata={"help": "Where indexes are cached (default: $MEMPO_CACHE/<retriever_type>)."}
    )
    retriever_timeout: float = field(default=TIMEOUT, metadata={"help": "Seconds per HTTP request to the server."})
    retriever_max_retries: int = field(
        default=MAX_RETRIES,
        metadata={
            "help": "HTTP retries after a failed request (`eval`, `ask`; training retries "
            "until `retriever_retry_budget` runs out)."
        },
    )
    retriever_retry_budget: float = field(
        default=RETRY_BUDGET,
        metadata={
            "help": "Seconds an unreachable `retriever_url` is retried (each outage logged); training then "
            "saves a checkpoint and stops: resume from it once the server is back."
        },
    )

    def __post_init__(self):
        if self.retriever_url:
            check_retriever_url(self.retriever_url)  # at parse time, before anything is loaded


def describe_retriever(args: RetrieverArguments) -> str:
    """One line naming the retriever ``args`` build (for logs and the model card).

    Example:
        >>> describe_retriever(RetrieverArguments(corpus="wiki.jsonl"))
        'BM25 over wiki.jsonl'
    """
    if args.retriever_url:
        return f"the retrieval server at {args.retriever_url}"
    kind = "BM25" if args.retriever_type == "bm25" else f"dense retrieval ({args.retriever_model})"
    return f"{kind} over {args.corpus}"


def build_retriever(args: RetrieverArguments, ride_out_outages: bool = False, **index_kwargs) -> Retriever:
    """The retriever `args` describe; `index_kwargs` go to the in-process index's `from_corpus`.

    With `ride_out_outages` (training), an HTTP retriever retries for `retriever_retry_budget` seconds whatever the
    number of attempts.

    Example:
        >>> build_retriever(RetrieverArguments(retriever_url="http://127.0.0.1:8000")).base_url
        'http://127.0.0.1:8000'
        >>> build_retriever(RetrieverArguments(corpus="data/wiki-18.jsonl", retriever_type="dense",
        ...                                    retriever_model="models/e5-base-v2"), batch_size=256).name  # doctest: +SKIP
        'dense'
    """
    from mempo_trl.retrieval.bm25 import BM25Retriever
    from mempo_trl.retrieval.dense import DenseRetriever
    from mempo_trl.retrieval.http_client import HttpRetriever

    if args.retriever_url:
        return HttpRetriever(
            args.retriever_url,
            timeout=args.retriever_timeout,
            max_retries=None if ride_out_outages else args.retriever_max_retries,
            retry_budget=args.retriever_retry_budget,
        )
    if not args.corpus:
        raise ValueError("no retriever: set `corpus` (a JSONL corpus) or `retriever_url` (a retrieval server).")
    if args.retriever_type == "dense":
        if not args.retriever_model:
            raise ValueError("retriever_type dense needs retriever_model: a local sentence-transformers directory.")
        return DenseRetriever.from_corpus(
            args.corpus, args.retriever_model, cache_dir=args.retriever_cache_dir, **index_kwargs
        )
    return BM25Retriever.from_corpus(args.corpus, cache_dir=args.retriever_cache_dir, **index_kwargs)
