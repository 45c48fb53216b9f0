"""`python bench/http.py --json`: runs bench/http_bench.py.

This file's name is the standard library's `http`, which httpx imports, and Python puts a
script's folder first on the import path. So: run as a script, take this folder off the path
and run the real benchmark; imported as `http` (by another script in this folder), hand the
importer the standard library's package instead.
"""

import importlib
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

if __name__ == "__main__":
    runpy.run_path(str(HERE / "http_bench.py"), run_name="__main__")
else:
    del sys.modules[__name__]
    sys.modules[__name__] = importlib.import_module("http")
