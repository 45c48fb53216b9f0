"""`python bench/http.py --json`: runs bench/http_bench.py.

This file's name is the standard library's `http`, which httpx imports; Python puts this
folder first on the import path, so take it off before running the real benchmark.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
runpy.run_path(str(HERE / "http_bench.py"), run_name="__main__")
