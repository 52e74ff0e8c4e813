"""Print the benchmark table of docs/benchmarks.md from the last run (bench/results).

``python bench/readme_table.py [RESULTS.json ...]`` writes Markdown to stdout, for each
results file (default: the last run's): a line describing the machine and the run, then
one row per figure, as ``bench/run.py`` printed it. The table in docs/benchmarks.md is
pasted from this, so that it never says more than a run measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(doc: dict) -> str:
    load = doc.get("loadavg_1min") or []
    load_text = f", load average {load[0]:.1f} at the start and {load[-1]:.1f} at the end" \
        if len(load) >= 2 else ""
    lines = [
        f"Run of {doc['created']} ({'quick' if doc.get('quick') else 'full'}, "
        f"{', '.join(doc.get('selected') or ['all'])}; {doc.get('seconds')} s): Python "
        f"{doc.get('python')} on {doc.get('platform')}, {doc.get('cpus')} CPUs{load_text}.",
        "",
        "| metric | deja | anchors | target | result |",
        "|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        lines.append("| " + " | ".join(_cell(str(row[k])) for k in
                                        ("metric", "deja", "anchor", "target", "result")) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [RESULTS]
    missing = [p for p in paths if not p.exists()]
    if missing:
        print(f"no {missing[0]}: run `make bench` first", file=sys.stderr)
        return 2
    print("\n\n".join(table(json.loads(p.read_text())) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
