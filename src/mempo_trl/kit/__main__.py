"""`python -m mempo_trl.kit build-demo|build-tiny-model|warm-start ...`, the same as `mempo-trl kit ...`."""

import sys

from mempo_trl.cli import main


if __name__ == "__main__":
    raise SystemExit(main(["kit", *sys.argv[1:]]))
