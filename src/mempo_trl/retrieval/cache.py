"""On-disk index caches: where they live and how an entry is written so that readers never see half of one."""

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


logger = logging.getLogger(__name__)


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
