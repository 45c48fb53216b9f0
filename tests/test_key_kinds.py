"""One namespace of key names per store (keyspace.py): a name is one key of one kind, on every
path. On main before it, a datacenter key `order` made `idmint next order` hint at `idmint keys
add order`, which made a plain key handing out 1 and 2 again; a segment key and a quorum key
named `ticket` on one server both handed out 1, 2, 3 (tests/test_quorum.py has the server)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import idmint
from idmint import UINT31_MAX, KeyExists, KeyNotFound, NameTaken, WrongKind
from idmint.cli import main as cli_main
from idmint.keyspace import KindCheckedRanges
from idmint.server import App, ServerConfig

from test_app import call


def test_a_name_is_one_key_of_one_kind(store_url: str, tmp_path: Path) -> None:
    eu = f"sqlite:///{tmp_path / 'eu.db'}"
    with idmint.connect(store_url) as minter:
        minter.add_datacenter_key("order", max=UINT31_MAX)
        minter.add_key("ticket")
        minter.add_quorum_key("vote", max=UINT31_MAX)
        makers: dict[str, Callable[[str], object]] = {
            "segment": minter.add_key,
            "datacenter": minter.add_datacenter_key,
            "quorum": minter.add_quorum_key,
        }
        kinds = {"order": "datacenter", "ticket": "segment", "vote": "quorum"}
        for name, kind in kinds.items():
            for other, make in makers.items():
                if other == kind:
                    with pytest.raises(KeyExists) as same:
                        make(name)
                    assert not isinstance(same.value, NameTaken)
                    continue
                with pytest.raises(NameTaken, match=f"already exists as a {kind} key"):
                    make(name)

        # Asked for as the wrong kind: what the key is and how to ask for it, never how to
        # make another key of that name.
        with pytest.raises(WrongKind, match=r"datacenter key, not a segment key.*--dc") as err:
            minter.segment("order").next_id()
        assert "add" not in str(err.value)
        with pytest.raises(WrongKind, match=r"quorum key.*--quorum"):
            minter.take("vote", 5)
        with pytest.raises(WrongKind, match=r"quorum key"):
            minter.key("vote")
        with pytest.raises(WrongKind, match=r"segment key, not a quorum key"):
            minter.quorum_key("ticket")
        with pytest.raises(WrongKind, match=r"segment key, not a datacenter key"):
            minter.datacenter("ticket", "eu", dc_store=eu).next_id()
        with pytest.raises(WrongKind, match=r"datacenter key"):
            minter.raise_floor("order", 10)
        # A name that is no key at all: the store it looked in, and the command for that kind.
        with pytest.raises(KeyNotFound, match=r"not found in .*`idmint keys add nope`") as nope:
            minter.key("nope")
        assert not isinstance(nope.value, WrongKind)
        with pytest.raises(KeyNotFound, match=r"`idmint dc add nope`"):
            minter.datacenter("nope", "eu", dc_store=eu).next_id()

        # Nothing was handed out under a wrong kind: each key starts at its first id.
        assert minter.take("ticket", 1).start == 1
        assert minter.datacenter("order", "eu", dc_store=eu).next_id() == 1
        assert minter.quorum_key("vote").max == UINT31_MAX
        assert [k.name for k in minter.quorum_keys()] == ["vote"]


def test_two_kinds_made_at_once_under_one_name_one_wins(shared_store_url: str) -> None:
    """The claim is one create: of two admins making a name as two kinds at once, exactly one
    makes a key (looking for the other kind first, then making, would let both)."""
    with idmint.connect(shared_store_url) as minter:
        minter.init()
        for round_ in range(6):
            name = f"race{round_}"
            start = threading.Barrier(2)
            made: list[str] = []
            refused: list[str] = []

            def make(
                kind: str,
                name: str = name,
                start: threading.Barrier = start,
                made: list[str] = made,
                refused: list[str] = refused,
            ) -> None:
                start.wait(10)
                try:
                    if kind == "segment":
                        minter.add_key(name)
                    else:
                        minter.add_datacenter_key(name)
                    made.append(kind)
                except NameTaken:
                    refused.append(kind)

            threads = [threading.Thread(target=make, args=(k,)) for k in ("segment", "dc")]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert len(made) == 1 and len(refused) == 1, (made, refused)


def test_keys_made_before_names_were_claimed_are_still_found(tmp_path: Path) -> None:
    """Keys of a store written before claims existed have no claim: their kind is found where
    it keeps them, and a second kind under their name is refused all the same."""
    with idmint.connect(f"sqlite:///{tmp_path / 'old.db'}") as minter:
        minter.store.add_key("legacy", step=10, first_id=1, last_id=100)  # no claim
        minter.datacenters().add_key("olddc", step=10, last_id=UINT31_MAX)  # no claim
        with pytest.raises(NameTaken, match="as a segment key"):
            minter.add_datacenter_key("legacy")
        with pytest.raises(NameTaken, match="as a datacenter key"):
            minter.add_key("olddc")
        with pytest.raises(NameTaken, match="as a datacenter key"):
            minter.add_quorum_key("olddc")
        with pytest.raises(WrongKind, match="datacenter key"):
            minter.take("olddc", 1)
        assert isinstance(minter.ranges, KindCheckedRanges)


def test_cli_refuses_a_second_kind_and_hints_at_the_right_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ["--store", f"sqlite:///{tmp_path / 'a.db'}"]
    eu = ["--dc", "eu", "--dc-store", f"sqlite:///{tmp_path / 'eu.db'}"]
    assert cli_main([*store, "dc", "add", "order", "--max", str(UINT31_MAX)]) == 0
    capsys.readouterr()
    for argv in (
        ["next", "order"],
        ["keys", "add", "order"],
        ["keys", "add", "order", "--exist-ok"],  # another kind's name is never "exists, fine"
        ["quorum", "add", "order"],
    ):
        assert cli_main([*store, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "datacenter key" in err and "--dc" in err and err.count("\n") == 1, err
        assert "keys add" not in err, err
    assert cli_main([*store, "next", "order", "-n", "2", *eu]) == 0
    assert capsys.readouterr().out.split() == ["1", "2"]
    assert cli_main([*store, "keys", "list", "--json"]) == 0
    assert capsys.readouterr().out == ""  # no plain key was made on the way
    assert cli_main([*store, "quorum", "add", "vote", "--max", "99"]) == 0
    assert cli_main([*store, "quorum", "add", "vote", "--max", "99", "--exist-ok"]) == 0
    assert cli_main([*store, "quorum", "add", "vote", "--max", "98", "--exist-ok"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main([*store, "quorum", "list"]) == 0
    assert capsys.readouterr().out == "vote  ids 1..99\n"


def test_every_http_route_refuses_another_kinds_name(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    with idmint.connect(url) as minter:
        minter.add_datacenter_key("order", max=UINT31_MAX)
        minter.add_key("plain")
    app = App(ServerConfig(store=url, admin_loopback=True))
    try:
        for path in (
            "/api/segment/get/order",  # Leaf
            "/v1/keys/order/ids",
            "/v1/keys/order/ranges?size=10",
            "/tinyid/id/nextIdSimple?bizType=order",
            "/ids/order",  # CosId
        ):
            method = "POST" if "ranges" in path else "GET"
            for _ in range(2):  # the second from the server's memory of missing names
                got = call(app, method, path)
                assert "datacenter key" in got.text and "--dc" in got.text, (path, got.text)
                assert got.status_code in (200, 404), (path, got.status_code)  # tinyid: 200
        made = call(app, "POST", "/v1/keys", json={"name": "order"})
        assert made.status_code == 409 and "datacenter key" in made.text
        assert call(app, "GET", "/v1/keys/plain/ids").json()["ids"] == [1]
    finally:
        app.shutdown()
    dc_app = App(ServerConfig(store=url, dc="eu", dc_store=f"sqlite:///{tmp_path / 'eu.db'}"))
    try:
        got = call(dc_app, "GET", "/api/segment/get/plain")
        assert got.status_code == 404 and "segment key, not a datacenter key" in got.text
        assert call(dc_app, "GET", "/api/segment/get/order").text == "1"
    finally:
        dc_app.shutdown()


def test_add_key_exist_ok_returns_the_same_key_and_refuses_another(tmp_path: Path) -> None:
    """Issue 31 row 4: the README's snippet raised KeyExists on its second run (add_key had no
    exist_ok, the CLI and add_quorum_key had). The same key again is returned; other settings,
    or a key of another kind under the name, still raise."""
    with idmint.connect(f"sqlite:///{tmp_path / 'k.db'}") as minter:
        made = minter.add_key("order", step=1000, start=100_000_000)
        again = minter.add_key("order", step=1000, start=100_000_000, exist_ok=True)
        assert (again.name, again.step, again.first_id) == (made.name, 1000, 100_000_000)
        with pytest.raises(KeyExists, match="its step is 1000, not 10"):
            minter.add_key("order", step=10, start=100_000_000, exist_ok=True)
        with pytest.raises(KeyExists):
            minter.add_key("order", step=1000, start=100_000_000)
        minter.add_quorum_key("vote")
        with pytest.raises(NameTaken):
            minter.add_key("vote", exist_ok=True)
