"""On-disk index caches: where they live and how an entry is written so that readers never see half of one."""

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)


class CachedIndex:
    """What the in-process indexes share: their passages and where their cache entry is (`load_or_build`)."""

    passages: list
    cache_path: Path | None = None  # the entry read or written; None when not cached
    cache_hit: bool = False  # True when the index was read from the cache

    @property
    def num_passages(self) -> int:
        return len(self.passages)


def cache_root() -> Path:
    """Root of the index caches: `$MEMPO_CACHE`, else `~/.cache/mempo_trl` (BM25 uses `<root>/bm25`).

    Example:
        >>> cache_root()  # MEMPO_CACHE unset, HOME=/root
        PosixPath('/root/.cache/mempo_trl')
    """
    return Path(os.environ.get("MEMPO_CACHE") or Path.home() / ".cache" / "mempo_trl").expanduser()


def write_entry(entry: Path, write: Callable[[Path], None]) -> bool:
    """Run `write(tmp_dir)` and rename `tmp_dir` to `entry`; return False (with a warning) if the disk refuses.

    A concurrent process that finished the same entry first wins; its copy is kept.

    Example:
        >>> write_entry(Path("/tmp/cache/abc"), lambda d: (d / "x.txt").write_text("hi"))
        True
    """
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        write(tmp)
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():
                raise
        return True
    except OSError as e:
        logger.warning("Could not write the index cache %s (%s); continuing without it.", entry, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_or_build(
    entry: Path,
    load: Callable[[Path], Any],
    build: Callable[[], Any],
    save: Callable[[Any, Path], None],
    what: str,
    cached_only: bool = False,
) -> Any:
    """The retriever cached in `entry`, or a new one built and written there (the sequence every index shares).

    `load(entry)` returns the cached retriever, or None when there is no entry; an entry it cannot read (OSError,
    ValueError, KeyError) is deleted and rebuilt, with a warning naming `what`. `build()` makes a new retriever and
    `save(retriever, tmp_dir)` writes it, atomically (`write_entry`). The result gets `cache_path` (None when the
    disk refused the entry) and `cache_hit`. With `cached_only`, a missing or unreadable entry raises `LookupError`
    instead of being built.

    Example:
        >>> retriever = load_or_build(entry, load, build, save, "BM25")  # doctest: +SKIP
    """
    try:
        cached = load(entry)
    except (OSError, ValueError, KeyError) as e:
        logger.warning("Rebuilding the unreadable %s cache entry %s (%s).", what, entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        cached = None
    if cached is not None:
        cached.cache_path, cached.cache_hit = entry, True
        return cached
    if cached_only:
        raise LookupError(f"no readable {what} index in the cache entry {entry}")
    built = build()
    built.cache_path = entry if write_entry(entry, lambda tmp: save(built, tmp)) else None
    built.cache_hit = False
    return built
