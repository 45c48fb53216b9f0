"""idmint without its `server` extra (granian, prometheus-client, uvloop): the library, its
clients and every command but `serve` work, and `serve` says in one line what to install.

The test venv has the extra (dev brings it), so each test runs a fresh interpreter whose
imports of those modules fail as if pip had never installed them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SERVER_EXTRA = ("granian", "prometheus_client", "uvloop")

#: Code run first in the child: a finder, ahead of every other, that refuses the modules named
#: in BLOCKED, as a missing package does (ModuleNotFoundError naming the module).
NOT_INSTALLED = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""

CLI = "from idmint.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def idmint_without(
    blocked: tuple[str, ...], *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    """`idmint ARGS` in a child that cannot import the `blocked` modules."""
    code = f"BLOCKED = {blocked!r}\n{NOT_INSTALLED}\n{CLI}"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=False,
    )


def test_the_key_commands_work_without_the_extra(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    added = idmint_without(SERVER_EXTRA, "--store", url, "keys", "add", "order", cwd=tmp_path)
    assert added.returncode == 0 and added.stdout.startswith("added order: "), added.stderr
    listed = idmint_without(SERVER_EXTRA, "--store", url, "keys", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == ["order", "1"]
    taken = idmint_without(SERVER_EXTRA, "--store", url, "next", "order", "-n", "2", cwd=tmp_path)
    assert (taken.returncode, taken.stdout) == (0, "1\n2\n"), taken.stderr


@pytest.mark.parametrize(
    ("blocked", "named"),
    [
        (SERVER_EXTRA, "prometheus_client"),  # the first that the server's modules import
        # granian alone: the server falls back to uvicorn, which the test venv lacks too.
        (("granian", "uvicorn"), "granian"),
    ],
)
def test_serve_without_the_extra_says_what_to_install(
    tmp_path: Path, blocked: tuple[str, ...], named: str
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    served = idmint_without(blocked, "serve", "--store", url, "--port", "1", cwd=tmp_path)
    assert served.returncode == 2 and not served.stdout
    assert served.stderr == (
        f"idmint: error: idmint serve needs {named}: pip install 'idmint[server]'\n"
    )
    assert not (tmp_path / "a.db").exists()  # said before anything else was done


def test_the_library_and_its_clients_never_import_the_server_extra(tmp_path: Path) -> None:
    script = f"""
import asyncio, sys
import idmint

minter = idmint.connect({f"sqlite:///{tmp_path / 'a.db'}"!r})
minter.add_key("order")
assert minter.segment("order").next_id() == 1
minter.close()
idmint.Client("http://127.0.0.1:1").close()

async def main() -> None:
    await idmint.AsyncClient("http://127.0.0.1:1").aclose()

asyncio.run(main())
print(sorted(m for m in sys.modules if m.partition(".")[0] in {SERVER_EXTRA!r}))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]", run.stdout
