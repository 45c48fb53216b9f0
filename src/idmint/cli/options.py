"""The options more than one command takes, each declared here once, and the parameter types.

A command may give a shared option its own help or default (`json_option(help="As a JSON
object.")`); the flag, its type and its variable stay the same everywhere. The options of the
server's settings (`--dc`, `--quorum`, every option of `serve`) are built from ServerConfig's
fields: each field says its flag, help and variable there (server/config.py, Flag).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import click
from click.core import ParameterSource

from ..ids import BATCH_CAP_MAX, DEFAULT_FIRST_ID, DEFAULT_STEP
from ..server.config import FLAGS, env_variable

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

#: Seconds to wait for the store, at least and at most (a config file's timeout too).
TIMEOUT_RANGE = (0.1, 600.0)
#: `next -n` and `snowflake -n` at most: a typo of a few zeros must not burn a bounded key (or
#: hold every id in memory) before anything is printed.
MAX_COUNT = 1_000_000


class Finite(click.ParamType[float]):
    """A finite number, within [low, high] when given. click's FloatRange lets NaN through (every
    comparison with NaN is false) and float takes "inf": both broke later, with a traceback."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None) -> None:
        self.low, self.high = low, high

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if (self.low is not None and number < self.low) or (
            self.high is not None and number > self.high
        ):
            self.fail(f"{number:g} is not from {self.low:g} to {self.high:g}", param, ctx)
        return number


class Int64(click.ParamType[int]):
    """An integer a store's BIGINT holds, checked further by the command (a stripe by the key's
    stripes). click's IntRange over that span printed both 19-digit ends in the help."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer", param, ctx)
        if not -(2**63) <= number < 2**63:
            self.fail(f"{value} is out of range: it must fit in 64 bits", param, ctx)
        return number


class Duration(click.ParamType[float]):
    """Seconds, or a number with a unit: 90s, 30m, 24h, 7d."""

    name = "duration"
    _units: ClassVar[dict[str, int]] = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower()
        unit = self._units.get(text[-1:], 0)
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            self.fail(f"{value!r} is not a duration (like 90s, 30m, 24h, 7d)", param, ctx)
        if not 0 < seconds < float("inf"):
            self.fail(f"{value!r} must be longer than 0", param, ctx)
        return seconds


def _shared(*decls: str, **attrs: Any) -> Callable[..., Decorator]:
    """An option declared once: each use may give other attributes (its help, its default)."""

    def make(**changes: Any) -> Decorator:
        return click.option(*decls, **{**attrs, **changes})

    return make


json_option = _shared("--json", "as_json", is_flag=True, help="One JSON object per key.")
description_option = _shared("--description", default="", help="Free text, up to 256 characters.")
exist_ok_option = _shared(
    "--exist-ok", is_flag=True, help="A key of that name already there is not an error."
)
start_option = _shared(
    "--start", type=int, default=DEFAULT_FIRST_ID, show_default=True, help="The first id."
)
step_option = _shared("--step", type=int, default=DEFAULT_STEP, show_default=True)
max_option = _shared("--max", "max_", type=int)
max_batch_option = _shared(
    "--max-batch",
    type=int,
    help="The most ids one HTTP request may take from the key (a range, a batch); 0: the step "
    f"x 100, at most {BATCH_CAP_MAX:,}.",
)
count_option = _shared("-n", "count", type=int, default=1, show_default=True, help="How many ids.")
layout_option = _shared(
    "--layout", default="twitter", show_default=True, help="twitter, sonyflake or js53."
)
namespace_option = _shared("--namespace", default="default", show_default=True)


def given_params(ctx: click.Context, *names: str) -> set[str]:
    """Which of these parameters the command line (or the environment) gave: no defaults."""
    return {n for n in names if ctx.get_parameter_source(n) is not ParameterSource.DEFAULT}


def _override(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is not None and param.name:
        ctx.obj[param.name] = value
        ctx.obj["given"].add(param.name)


def store_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--store and --timeout after the command name too: `idmint serve --store URL`. They
    change what the group's own --store and --timeout put in ctx.obj."""
    command = click.option(
        "--timeout",
        type=Finite(*TIMEOUT_RANGE),
        expose_value=False,
        callback=_override,
        help="Seconds to wait for the store (also before the command).",
    )(command)
    return click.option(
        "--store",
        metavar="URL",
        expose_value=False,
        callback=_override,
        help="Store URL (also before the command, or IDMINT_STORE).",
    )(command)


def setting_option(name: str, **changes: Any) -> Decorator:
    """The option of server setting `name`, as its Flag in ServerConfig says. It defaults to
    None (a switch too): what the command line did not give comes from elsewhere."""
    flag, default = FLAGS[name]
    attrs: dict[str, Any] = {
        "help": flag.describe(name, default),
        "metavar": flag.metavar,
        "envvar": env_variable(name) if flag.env else None,
        "default": None,
    }
    if isinstance(default, bool):
        attrs["is_flag"] = True
    elif flag.choices:
        attrs["type"] = click.Choice(flag.choices)
    elif isinstance(default, float):
        attrs["type"] = Finite()  # ServerConfig checks the range, naming the setting
    elif isinstance(default, int):
        attrs["type"] = int
    return click.option(flag.opts or "--" + name.replace("_", "-"), name, **{**attrs, **changes})


def stacked(*options: Decorator) -> Decorator:
    """One decorator for several options, listed in the help in this order."""

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):  # the decorator applied last is listed first
            command = option(command)
        return command

    return add


def setting_options(*names: str) -> Decorator:
    """The options of these server settings, in this order."""
    return stacked(*(setting_option(name) for name in names))


def dc_options(*, required: bool = False) -> Decorator:
    """--dc NAME and --dc-store URL: serve datacenter keys as that datacenter."""
    return stacked(setting_option("dc", required=required), setting_option("dc_store"))


#: --quorum URLS, --unsafe-nodes and --replicated-nodes: the nodes of a quorum key.
quorum_options = setting_options("quorum", "unsafe_nodes", "replicated_nodes")
