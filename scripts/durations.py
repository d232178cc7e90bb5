"""Where the suite's time goes, from a pytest junit XML (what `.ci/run` writes).

    python scripts/durations.py .ci-results/junit.xml                 # summary: tiers, slowest tests, files
    python scripts/durations.py .ci-results/junit.xml --write tests/durations.json

The XML's test cases carry their tier and own time as properties (tests/suite_budget.py); their
`time` is setup + call + teardown, so shared fixtures show up in the test that first needed them;
an executed notebook's also carry its slowest cells ("[24]46s": code cell 24 took 46 s).
`--write` records the run (date, commit, tier, wall time, every test) for the README's suite times.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def node_id(case: ET.Element) -> str:
    parts = case.get("classname", "").split(".")
    cls = [p for p in parts if p[:1].isupper()]
    mod = [p for p in parts if not p[:1].isupper()]
    return "/".join(mod) + ".py::" + "::".join([*cls, case.get("name", "")])


def read(path: Path) -> tuple[dict, list[dict]]:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        cases.append({"id": node_id(case), "s": float(case.get("time", 0)), "tier": props.get("tier", "default"),
                      "own_s": float(props["own_s"]) if "own_s" in props else None, "outcome": outcome,
                      "cells": props.get("slowest_cells")})  # a notebook's slowest cells (tests/test_notebooks.py)
    head = {"wall_s": float(suite.get("time", 0)), "timestamp": suite.get("timestamp"),
            "tests": int(suite.get("tests", len(cases)))}
    return head, cases


def summary(head: dict, cases: list[dict], top: int) -> str:
    lines = [f"{len(cases)} tests, {head['wall_s'] / 60:.1f} min of pytest time ({head['wall_s']:.0f} s)"]
    by_tier: dict[str, list[float]] = defaultdict(list)
    for c in cases:
        by_tier[c["tier"]].append(c["s"])
    for tier, times in sorted(by_tier.items()):
        lines.append(f"  {tier:8s} {len(times):4d} tests  {sum(times) / 60:6.1f} min")
    outcomes = defaultdict(int)
    for c in cases:
        outcomes[c["outcome"]] += 1
    lines.append("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    lines.append(f"slowest {top} (setup + call + teardown):")
    for c in sorted(cases, key=lambda c: -c["s"])[:top]:
        lines.append(f"  {c['s']:7.1f} s  {c['tier']:7s}  {c['id']}" + (f"  cells {c['cells']}" if c["cells"] else ""))
    files: dict[str, float] = defaultdict(float)
    for c in cases:
        files[c["id"].split("::")[0]] += c["s"]
    lines.append("by file:")
    for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {s:7.1f} s  {f}")
    return "\n".join(lines)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--write", type=Path, help="record this run as JSON (tests/durations.json)")
    ap.add_argument("--closing", action="store_true", help="end with a plain 'suite: N passed, N failed' line")
    a = ap.parse_args()
    head, cases = read(a.junit)
    print(summary(head, cases, a.top))
    if a.write:
        tiers = sorted({c["tier"] for c in cases})
        record = {"date": head["timestamp"] or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit(), "tiers_run": tiers, "wall_s": round(head["wall_s"], 1),
                  "tests": {c["id"]: {"s": round(c["s"], 2), "tier": c["tier"], "outcome": c["outcome"],
                                      **({"cells": c["cells"]} if c["cells"] else {})}
                            for c in sorted(cases, key=lambda c: c["id"])}}
        a.write.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {a.write}")
    if a.closing:
        n = lambda *kinds: sum(c["outcome"] in kinds for c in cases)  # noqa: E731
        print(f"suite: {n('passed')} passed, {n('failure', 'error')} failed, {n('skipped')} skipped")


if __name__ == "__main__":
    main()
