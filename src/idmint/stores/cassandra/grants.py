"""What idmint's Cassandra user needs (docs/stores.md "Locked down"), in one place so that the
docs, the tests (which run idmint under exactly this grant) and the code agree.

Least privilege: an administrator makes the keyspace and its tables once (`idmint init` with
a superuser's URL, or the CQL of docs/stores.md), and idmint's user may then only read and
write that keyspace's tables: SELECT (cells, leases, the identity; Paxos reads too) and MODIFY
(every INSERT and UPDATE, lightweight transactions included). The system tables the driver
and `now()` read are readable by every user. A user given CREATE on the keyspace as well lets
idmint make missing tables itself (a keyspace dropped by hand is then still an administrator's
to make again: creating keyspaces needs CREATE on ALL KEYSPACES).
"""

from __future__ import annotations

#: The permissions on the keyspace, in `GRANT ... ON KEYSPACE ks TO user` order.
GRANTS = ("SELECT", "MODIFY")


def grant_cql(user: str, keyspace: str = "idmint") -> list[str]:
    """The GRANT statements that give `user` what idmint needs on `keyspace`."""
    return [f"GRANT {permission} ON KEYSPACE {keyspace} TO {user};" for permission in GRANTS]
