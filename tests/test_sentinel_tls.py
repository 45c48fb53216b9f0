"""Redis Sentinel locked down (issue 33): three Sentinels and a primary and replica that take
clients over TLS only with a certificate of the test CA (tests/certs.py), the Sentinels talking
to the servers and each other over TLS too (`tls-replication`), the replica following its
primary over TLS. `redis+sentinel://` with `ca=`, `cert=`, `key=` reaches the Sentinels and the
primary they name over TLS, follows a failover, and hands out no id twice; a wrong CA is one
clear line."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pytest

import idmint
from idmint import StoreUnavailable

from certs import Certs
from harness import duplicates
from replicated import redis_pair
from server_redis import Sentinels
from servers import wait_until

SERVICE = "locked"


@pytest.fixture(scope="module")
def tls_sentinels(certs: Certs) -> Iterator[Sentinels]:
    with Sentinels(3, certs=certs) as started:
        yield started


def _query(certs: Certs, prefix: str) -> str:
    files = {"ca": certs.ca, "cert": certs.client_cert, "key": certs.client_key}
    return "&".join([f"prefix={prefix}"] + [f"{k}={quote(str(v))}" for k, v in files.items()])


def test_sentinel_over_tls_serves_and_follows_a_failover(
    tls_sentinels: Sentinels, certs: Certs
) -> None:
    with redis_pair(certs=certs) as (primary, replica):
        assert primary.tls_port is not None and replica.tls_port is not None
        tls_sentinels.monitor(SERVICE, primary, port=primary.tls_port)
        try:
            url = tls_sentinels.url(SERVICE, _query(certs, "tlsfail"), tls=True)
            handed: list[int] = []
            with idmint.connect(url, timeout=2) as minter:
                minter.add_key("k", step=10)
                handed += minter.take("k", 25)
            primary.kill()
            tls_sentinels.await_primary(SERVICE, replica, port=replica.tls_port)
            # The old primary back, made a replica of the new one by the Sentinels (over TLS):
            # the store recorded one replica, and writes wait for one again.
            primary.start()
            with idmint.connect(url, timeout=2) as minter:
                # the first calls after the promotion may find it still fencing: a bounded retry
                errors: list[str] = []

                def take() -> bool:
                    try:
                        handed.extend(minter.take("k", 25))
                    except StoreUnavailable as exc:
                        errors.append(str(exc))
                        return False
                    return True

                wait_until(take, 30, f"ids from the promoted replica over TLS ({errors[-1:]})")
            assert len(handed) == 50 and not duplicates(handed), handed
        finally:
            tls_sentinels.remove(SERVICE)


def test_sentinel_with_a_wrong_ca_is_one_clear_line(tls_sentinels: Sentinels, certs: Certs) -> None:
    url = tls_sentinels.url(SERVICE, _query(certs, "tlsca"), tls=True)
    wrong = url.replace(quote(str(certs.ca)), quote(str(certs.wrong_ca)))
    assert wrong != url
    with idmint.connect(wrong, timeout=2) as minter, pytest.raises(StoreUnavailable) as caught:
        minter.add_key("k")
    text = str(caught.value)
    assert "\n" not in text, text
    assert "TLS: the server's certificate was not accepted (" in text, text
    assert "<redis" not in text, text  # not redis-py's client objects, as it lists them
