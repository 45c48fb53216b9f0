"""stores/registry.py is the one list of engines: every row opens (without I/O) an engine of
its kind with exactly the capabilities the row states, every scheme reaches its row, and the
messages that name engines read the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from idmint import InvalidArgument
from idmint.stores import open_engine, registry

#: A URL of each engine's form: opening one does no I/O, so nothing needs to listen there.
SAMPLE_URLS = {
    "sqlite": "sqlite:///{tmp}/x.db",
    "postgresql": "postgresql://idmint@127.0.0.1:1/ids",
    "mysql": "mysql://idmint@127.0.0.1:1/ids",
    "redis": "redis://127.0.0.1:1/0",
    "etcd": "etcd://127.0.0.1:1/ids",
    "zookeeper": "zk://127.0.0.1:1/idmint",
    "cassandra": "cassandra://127.0.0.1:1/ids",
    "memory": "memory://registry",
}


def test_every_row_opens_its_engine_with_the_capabilities_it_states(tmp_path: Path) -> None:
    assert sorted(SAMPLE_URLS) == sorted(row.kind for row in registry.SHIPPED)
    for row in registry.SHIPPED:
        for scheme in row.schemes:
            url = SAMPLE_URLS[row.kind].format(tmp=tmp_path)
            url = scheme + url[url.index("://") :]
            engine = open_engine(url, timeout=0.5)
            try:
                assert (engine.kind, engine.capabilities) == (row.kind, row.capabilities), url
            finally:
                engine.close()


def test_a_missing_capability_names_the_engines_that_have_it() -> None:
    engine = open_engine(SAMPLE_URLS["cassandra"], timeout=0.5)
    with pytest.raises(InvalidArgument, match="has no quorum nodes") as caught:
        engine.quorum()
    assert ", ".join(registry.engines_with("quorum")) in str(caught.value)
    assert "cassandra" not in registry.engines_with("quorum")


def test_an_unknown_scheme_names_every_scheme() -> None:
    with pytest.raises(InvalidArgument, match="bad store URL") as caught:
        open_engine("mongodb://127.0.0.1/ids")
    for scheme in registry.schemes():
        assert f"{scheme}://" in str(caught.value)


def test_a_scheme_belongs_to_one_engine() -> None:
    taken = registry.EngineRow(
        "copy", ("zk",), "idmint.stores.zookeeper:open_zookeeper_engine", None
    )
    with pytest.raises(ValueError, match="belong to another engine"):
        registry.register(taken)
    schemes = registry.schemes()
    assert len(schemes) == len(set(schemes))


def test_the_docs_and_the_package_follow_the_rows() -> None:
    """docs/stores.md's table of engines shows every scheme and driver extra; every extra is
    one pyproject.toml defines; and the engine that raises DriverMissing names its row's."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs/stores.md").read_text()
    table = docs[docs.index("## Engines") :].split("\n\n")[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for row in registry.SHIPPED:
        for scheme in row.schemes:
            assert f"`{scheme}://" in table, scheme
        if row.extra is not None:
            assert f"`idmint[{row.extra}]`" in table and row.extra in extras, row.extra
            module = (
                root / "src/idmint/stores" / row.opener.split(":")[0].strip(".").replace(".", "/")
            )
            sources = module.rglob("*.py") if module.is_dir() else [module.with_suffix(".py")]
            assert any(f"idmint[{row.extra}]" in p.read_text() for p in sources), row.kind
