"""The retriever settings every command shares (`RetrieverArguments`) and the one function that builds from them."""

from dataclasses import dataclass, field


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
    retriever_timeout: float = field(default=30.0, metadata={"help": "Seconds per HTTP request to the server."})
    retriever_max_retries: int = field(
        default=3, metadata={"help": "HTTP retries after a failed request (`eval`, `ask`; training retries until "
                             "`retriever_retry_budget` runs out)."}
    )  # fmt: skip
    retriever_retry_budget: float = field(
        default=600.0,
        metadata={"help": "Seconds an unreachable `retriever_url` is retried (each outage logged); training then "
                  "saves a checkpoint and stops: resume from it once the server is back."},
    )  # fmt: skip


def build_retriever(
    args: RetrieverArguments, default_corpus: str | None = None, ride_out_outages: bool = False, **index_kwargs
):
    """The retriever `args` describe (`default_corpus` when it names none); `index_kwargs` go to the index.

    With `ride_out_outages` (training), an HTTP retriever retries for `retriever_retry_budget` seconds whatever the
    number of attempts.

    Example:
        >>> build_retriever(RetrieverArguments(retriever_url="http://127.0.0.1:8000")).base_url
        'http://127.0.0.1:8000'
    """
    from mempo_trl.retrieval import load_retriever

    if args.retriever_url:
        return load_retriever(
            args.retriever_url,
            timeout=args.retriever_timeout,
            max_retries=None if ride_out_outages else args.retriever_max_retries,
            retry_budget=args.retriever_retry_budget,
        )
    corpus = args.corpus or default_corpus
    if corpus is None:
        raise ValueError("no retriever: set `corpus` (a JSONL corpus) or `retriever_url` (a retrieval server).")
    if args.retriever_type == "dense":
        if not args.retriever_model:
            raise ValueError("retriever_type dense needs retriever_model: a local sentence-transformers directory.")
        spec = f"dense:{args.retriever_model}:{corpus}"
    else:
        spec = f"bm25:{corpus}"
    return load_retriever(spec, cache_dir=args.retriever_cache_dir, **index_kwargs)
