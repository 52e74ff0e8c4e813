"""A scheduled job: it writes this week's report and declares it as the run's artefact
(see docs/runs.md, "Scheduled runs and absence alerts"). The schedule's deadline is met only
by a completed run whose signed cassette holds the report's hash."""

from pathlib import Path

import recorder

week = recorder.utcnow().strftime("%G-W%V")
report = Path("reports") / f"weekly-{week}.txt"
report.parent.mkdir(exist_ok=True)
report.write_text(f"weekly report {week}: 20 invoices reconciled, 0 open\n")
recorder.artefact(report)
print(f"wrote {report}")
