"""`python -m mempo_trl.kit build-demo|build-tiny-model|warm-start ...`, the same as `mempo-trl kit ...`."""

from mempo_trl.kit.cli import main


if __name__ == "__main__":
    raise SystemExit(main())
