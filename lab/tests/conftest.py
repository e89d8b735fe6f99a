"""The lab's tests use the library tests' fixtures (`tests/conftest.py`: the tiny and Qwen2.5-shaped models, the
demo data)."""

import importlib.util
from pathlib import Path


_spec = importlib.util.spec_from_file_location("library_fixtures", Path(__file__).parents[2] / "tests" / "conftest.py")
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
globals().update({name: value for name, value in vars(_fixtures).items() if hasattr(value, "_fixture_function")})
