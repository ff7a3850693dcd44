"""Where the suite's time goes: the JUnit reports `scripts/test.sh` writes into .test-reports/
(one per ComfyUI run), summed per test file and per layer (a module's server boot counts in its
first test's setup, so it lands on its file).

    .venv/bin/python scripts/durations.py                 # every report in .test-reports/
    .venv/bin/python scripts/durations.py --top 15 a.xml  # the 15 slowest files of one report
    .venv/bin/python scripts/durations.py --failures a.xml b.xml  # what failed, one line each

Prints, per report: the total, each layer's total (tests/<layer>/...), then the slowest files
(setup, call and teardown together) with their test counts: the table issue 40 asks for. Beside
each time, the CPU seconds the tests and everything they started used (the `cpu_s` property
tests/conftest.py records): with runs sharing 2 cores, the time says how busy the machine was."""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

REPORTS = Path(__file__).resolve().parents[1] / ".test-reports"


def file_of(case: ET.Element) -> str:
    """tests/<layer>/<file>.py of a test case (JUnit names it by dotted class path)."""
    name = case.get("classname", "")
    parts = name.split(".")
    while parts and parts[-1][:1].isupper():  # test classes
        parts.pop()
    return "/".join(parts) + ".py" if parts else "?"


def summary(report: Path, top: int) -> str:
    root = ET.parse(report).getroot()
    per_file: dict[str, float] = collections.defaultdict(float)
    cpu_file: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for case in root.iter("testcase"):
        where = file_of(case)
        per_file[where] += float(case.get("time", 0))
        cpu = [float(p.get("value", 0)) for p in case.iter("property") if p.get("name") == "cpu_s"]
        cpu_file[where] += sum(cpu)
        counts[where] += 1
    per_layer: dict[str, float] = collections.defaultdict(float)
    cpu_layer: dict[str, float] = collections.defaultdict(float)
    for where, seconds in per_file.items():
        parts = where.split("/")
        layer = "/".join(parts[:2]) if len(parts) > 2 else where
        per_layer[layer] += seconds
        cpu_layer[layer] += cpu_file[where]
    total, cpu = sum(per_file.values()), sum(cpu_file.values())
    lines = [f"{report.name}: {total:.0f} s ({cpu:.0f} s of CPU) in {sum(counts.values())} tests", ""]
    lines += ["| layer | s | CPU s |", "|---|---|---|"]
    lines += [
        f"| {layer} | {s:.0f} | {cpu_layer[layer]:.0f} |"
        for layer, s in sorted(per_layer.items(), key=lambda kv: -kv[1])
    ]
    lines += ["", "| file | tests | s | CPU s |", "|---|---|---|---|"]
    slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:top]
    lines += [f"| {where} | {counts[where]} | {s:.0f} | {cpu_file[where]:.0f} |" for where, s in slowest]
    return "\n".join(lines)


def failures(report: Path) -> list[str]:
    """A line per failed or erroring test of a report: its id and the first line of its message.
    `scripts/test.sh` prints these last, so that the end of a CI log (often all it keeps) says
    what failed."""
    root = ET.parse(report).getroot()
    lines = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            for found in case.findall(outcome):
                message = (found.get("message") or found.text or "").strip().splitlines()
                where = f"{file_of(case)}::{case.get('name')}"
                lines.append(f"{outcome}: {where}: {message[0][:300] if message else '(no message)'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--failures", action="store_true", help="list what failed, not the time")
    options = parser.parse_args()
    if options.failures:
        for report in options.reports:
            if not report.is_file():
                print(f"{report.name}: no report (the run ended before pytest wrote it: see its lines)")
                continue
            found = failures(report)
            print(f"{report.name}: " + (f"{len(found)} failed" if found else "nothing failed"))
            for line in found:
                print(f"  {line}")
        return
    reports = options.reports or sorted(REPORTS.glob("*.xml"))
    if not reports:
        raise SystemExit(f"no reports: run scripts/test.sh first (it writes {REPORTS}/*.xml)")
    print("\n\n".join(summary(report, options.top) for report in reports))


if __name__ == "__main__":
    main()
