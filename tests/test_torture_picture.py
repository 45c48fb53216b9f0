"""The torture run's picture (tests/torture_kit/picture.py): the page parses with every tag
closed in order, shows one line per process, one band per fault and the verdict, runs no
script, escapes what it is given, and stays small and quick for a run of hours."""

from __future__ import annotations

import math
import time
from html.parser import HTMLParser
from typing import Any

import pytest
from torture_kit.picture import MAX_ERROR_MARKS, MAX_POINTS, render_html

VOID = {"meta", "br", "hr", "img", "link", "input"}


class Page(HTMLParser):
    """The page's elements, checking on the way that every tag is closed, in order."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()
        assert self.stack == [], f"never closed: {self.stack}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def all(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [
            attrs
            for t, attrs in self.elements
            if t == tag and (cls is None or cls in attrs.get("class", "").split())
        ]


def summary(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "setup": "redis-replica",
        "seed": 123,
        "seconds": 30.0,
        "verdict": "ok",
        "problems": [],
        "ids": 123456,
        "repeated": 0,
        "faults": {"kill-client": 1, "partition": 1},
        "timeline": {
            "bucket": 0.5,
            "processes": {
                "lib-segment-0": {
                    "strategy": "segment",
                    "rate": [[i * 0.5, 1200.0 + 10 * i] for i in range(60)],
                    "errors": [[3.2, "StoreUnavailable"], [3.21, "StoreUnavailable"]],
                },
                "lib-snowflake-1": {
                    "strategy": "snowflake",
                    # Killed from 10 s to 14 s: no samples there.
                    "rate": [[i * 0.5, 900.0] for i in range(60) if not 20 <= i < 28],
                    "errors": [],
                },
            },
            "faults": [
                {
                    "kind": "partition",
                    "target": "client lib-segment-0 <-> store",
                    "start": 4.0,
                    "end": 7.5,
                },
                {"kind": "kill-client", "target": "lib-snowflake-1", "start": 10.0, "end": 14.0},
            ],
        },
        "outages": [
            {
                "kind": "partition",
                "target": "client lib-segment-0 <-> store",
                "start": 4.0,
                "end": 7.5,
                "longest_gap": 1.2,
                "bound": 5.0,
                "ok": True,
            }
        ],
    }
    base.update(changes)
    return base


def test_a_small_run() -> None:
    text = render_html(summary())
    page = Page(text)
    assert "<script" not in text.lower()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert len(page.all("svg", None)) >= 1
    assert len(page.all("path", "rate")) == 2
    assert len(page.all("rect", "band")) == 2
    [verdict] = page.all("div", "verdict")
    assert verdict["class"] == "verdict ok"
    words = " ".join(page.text)
    assert "redis-replica" in words and "seed 123" in words
    assert "lib-segment-0" in words and "lib-snowflake-1" in words
    # Both errors fall on one pixel: one cross, whose title counts them.
    assert len(page.all("path", "error")) == 1
    assert "StoreUnavailable \N{MULTIPLICATION SIGN}2" in words
    # The killed client's line breaks where its samples stop.
    [_, snowflake] = page.all("path", "rate")
    assert snowflake["d"].count("M") == 2
    assert "Problems" not in words


def test_a_failing_run() -> None:
    over = {
        "kind": "partition",
        "target": "store",
        "start": 20.0,
        "end": 25.0,
        "longest_gap": 7.0,
        "bound": 5.0,
        "ok": False,
    }
    failing = summary(
        verdict="fail",
        problems=["3 ids repeated: 17, 18, 19", "partition on store: outage 7.0 s > 5.0 s"],
        repeated=3,
    )
    failing["outages"].append(over)
    text = render_html(failing)
    page = Page(text)
    [verdict] = page.all("div", "verdict")
    assert verdict["class"] == "verdict fail"
    words = " ".join(page.text)
    assert "FAIL" in words
    assert "3 ids repeated: 17, 18, 19" in words
    # The outage with no matching timeline fault still gets its band, and its row is marked.
    assert len(page.all("rect", "band")) == 3
    assert len(page.all("tr", "over")) == 1


def test_strings_are_escaped() -> None:
    nasty = '<b>&"x'
    run = summary()
    run["setup"] = "<i>setup</i>"
    run["problems"] = ["<script>alert(1)</script>"]
    run["timeline"]["processes"][nasty] = {
        "strategy": "<s>",
        "rate": [[0.0, 1.0], [0.5, 2.0]],
        "errors": [[0.2, "<Err&>"]],
    }
    run["timeline"]["faults"].append({"kind": "<k>", "target": "<t&>", "start": 1, "end": 2})
    text = render_html(run)
    page = Page(text)
    assert "<b>" not in text and "<i>" not in text and "<script" not in text
    assert "&lt;b&gt;&amp;&quot;x" in text
    assert "&lt;Err&amp;&gt;" in text and "&lt;t&amp;&gt;" in text
    words = " ".join(page.text)
    assert nasty in words and "<script>alert(1)</script>" in words
    assert len(page.all("path", "rate")) == 3


@pytest.mark.parametrize(
    "run",
    [
        {},
        {"verdict": "ok"},
        {"setup": "x", "seed": 1, "seconds": 5.0, "verdict": "ok", "timeline": {}},
        {"timeline": {"processes": {}, "faults": []}, "outages": []},
        {"timeline": {"processes": {"p": {"rate": [], "errors": [[1.0, "E"]]}}}},
        {"timeline": {"faults": [{"kind": "kill-client", "start": 2.0}]}},
        # Rubbish where numbers should be is skipped, not fatal.
        {"timeline": {"processes": {"p": {"rate": [[0, "x"], [None, 1], [1, math.nan], 7]}}}},
    ],
)
def test_sparse_summaries_render(run: dict[str, Any]) -> None:
    page = Page(render_html(run))
    assert len(page.all("svg")) >= 1
    assert len(page.all("rect", "band")) == len(run.get("timeline", {}).get("faults", []))


def test_no_processes_no_faults() -> None:
    run = summary(outages=[], faults={})
    run["timeline"] = {"bucket": 0.5, "processes": {}, "faults": []}
    text = render_html(run)
    page = Page(text)
    assert page.all("path", "rate") == [] and page.all("rect", "band") == []
    assert "no rate samples" in text and "No faults." in text


def test_three_hours_stays_small_and_quick() -> None:
    seconds, bucket = 3 * 3600.0, 0.1
    n = int(seconds / bucket)
    processes = {
        f"lib-{s}-{i}": {
            "strategy": s,
            "rate": [
                [k * bucket, 1000.0 + 500 * math.sin(k / 997) + 37 * (k % 7)] for k in range(n)
            ],
            "errors": [[k * 0.9 + i * 0.3, "StoreUnavailable"] for k in range(12000)],
        }
        for i, s in enumerate(("segment", "snowflake", "datacenter", "quorum"))
    }
    faults = [
        {"kind": ("partition", "kill-client")[k % 2], "target": "store", "start": k, "end": k + 5}
        for k in range(0, int(seconds), 20)
    ]
    run = summary(seconds=seconds, timeline={"bucket": bucket, "processes": processes})
    run["timeline"]["faults"] = faults
    run["outages"] = []
    started = time.perf_counter()
    text = render_html(run)
    took = time.perf_counter() - started
    assert took < 2.0, f"{took:.2f} s"
    assert len(text.encode()) < 2_000_000, len(text)
    page = Page(text)
    paths = page.all("path", "rate")
    assert len(paths) == 4
    for path in paths:
        points = path["d"].count(" ") // 2 + 1
        assert points <= MAX_POINTS + 10, points
    assert len(page.all("path", "error")) == MAX_ERROR_MARKS
    assert "not drawn" in text
    assert len(page.all("rect", "band")) == len(faults)


def test_many_processes_share_colours_by_strategy() -> None:
    processes = {
        f"p{i}": {
            "strategy": ("segment", "snowflake")[i % 2],
            "rate": [[0, i], [1, i]],
            "errors": [[0.5, "Boom"]] if i == 3 else [],
        }
        for i in range(45)
    }
    text = render_html(summary(timeline={"processes": processes}, outages=[]))
    page = Page(text)
    paths = page.all("path", "rate")
    assert len(paths) == 45
    assert len({p["stroke"] for p in paths}) == 2
    assert len(page.all("li")) == 2  # the legend: one entry per strategy
    # So many processes share one row of errors, whose crosses name the process.
    assert len(page.all("text", "rowlabel")) == 1
    assert len(page.all("path", "error")) == 1 and "p3: Boom" in text
