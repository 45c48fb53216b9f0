"""What idmint's Redis user needs (its ACL rule, docs/stores.md "Locked down"), and what a
refusal means, in one line naming the store (`describe`): a TLS handshake that failed, a user
or password the server refused, a command or key the ACL denies.

The rule is built here so that the docs, the tests (which run idmint under exactly this rule)
and the code agree. Every command idmint sends, itself or from its Lua scripts (Redis checks
the user's ACL for a script's calls too, keys included):

- scripts: EVAL, EVALSHA and SCRIPT LOAD (redis-py loads a script the server has not cached);
- the cells, leases and the guard's lineage: GET, SET, DEL, EXISTS, PEXPIRE, PTTL, HGET, HMGET,
  HSET, HDEL, HINCRBY, ZADD, ZRANGEBYLEX, TIME, and SCAN, MULTI, EXEC to list lease holders;
- the replication guard (failover.py): INFO (read inside every writing script: `INFO
  replication`) and WAIT (for the replicas after each write). Without INFO every write is
  refused, and the message says INFO is missing: nothing else shows a failover;
- SELECT, for a database other than 0 in the URL.

Keys: the prefix's own, `~PREFIX:*`. No channels. CONFIG GET is not in the rule: it reads every
setting (passwords included); a cell store that may not run it takes the server's
persistence on trust, and a quorum node, which must show it fsyncs, needs `+config|get` too
(`acl_rule(prefix, quorum=True)`).
"""

from __future__ import annotations

import re

from ..tls import handshake_failure

#: Every command idmint's user runs (ACL names: `script|load` is SCRIPT LOAD).
COMMANDS = (
    "eval",
    "evalsha",
    "script|load",
    "get",
    "set",
    "del",
    "exists",
    "pexpire",
    "pttl",
    "hget",
    "hmget",
    "hset",
    "hdel",
    "hincrby",
    "zadd",
    "zrangebylex",
    "time",
    "scan",
    "multi",
    "exec",
    "info",
    "wait",
    "select",
)

#: What a quorum node needs on top: CONFIG GET shows the node fsyncs every claim.
QUORUM_COMMANDS = ("config|get",)


def acl_rule(prefix: str = "idmint", *, quorum: bool = False) -> str:
    """The ACL rule (the words after `ACL SETUSER name on >password`) for idmint on `prefix`:
    its keys, no channels, its commands and nothing else."""
    commands = COMMANDS + (QUORUM_COMMANDS if quorum else ())
    return " ".join(
        ["resetkeys", f"~{prefix}:*", "resetchannels", "-@all", *(f"+{c}" for c in commands)]
    )


# "NOPERM this user has no permissions to run the 'info' command" (7.0; later versions say
# "User NAME has no permissions ..."), in a script's error too.
_NOPERM_COMMAND = re.compile(r"no permissions to run the '([^']+)' command", re.I)


def _refused(exc: BaseException, text: str) -> bool:
    """Whether `exc` is the server refusing a command or key to the user (NOPERM; redis-py
    takes the code off the message and makes it a NoPermissionError; in a script: "can't
    run this command")."""
    names = {type(e).__name__ for e in (exc, exc.__cause__) if e is not None}
    return (
        "NoPermissionError" in names
        or "NOPERM" in text
        or "no permissions to" in text
        or "can't run this command" in text
    )


def describe(exc: BaseException, display: str, timeout: float | None = None) -> str:
    """One line about a failure of the store `display` (the URL without its secrets): what a
    TLS, authentication or permission failure means and what to do; otherwise the driver's
    message. Never the password: the driver's messages do not hold it, and `display` is
    redacted."""
    tls = handshake_failure(exc)
    if tls is not None:
        return f"store {display} unavailable: {tls}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "WRONGPASS" in text or "invalid username-password" in text.lower():
        return (
            f"store {display} unavailable: the server refused the URL's user and password "
            "(WRONGPASS: a wrong password, an unknown user, or a user turned off)"
        )
    if "NOAUTH" in text:
        return (
            f"store {display} unavailable: the server requires a password "
            "(NOAUTH): give the user and password in the URL (redis://user:password@host)"
        )
    if _refused(exc, text):
        command = _NOPERM_COMMAND.search(text)
        if command:
            what = f"may not run {command.group(1).upper()}"
        elif "may not run INFO" in text:
            what = "may not run INFO"
        elif "keys" in text:
            what = "may not use the keys under its prefix"
        else:
            what = "may not run a command of idmint's scripts"
        return (
            f"store {display} unavailable: the URL's user {what} ({text}); grant it the rule "
            "of docs/stores.md (Redis: locked down)"
        )
    if timeout is not None and "timeout" in type(exc).__name__.lower():
        text += f" (no answer within {timeout:g} s)"
    return f"store {display} unavailable: {text}"
