"""An agent that needs a person before it pays: run it with `deja submit` (see docs/runs.md,
"Runs out of the request cycle").

It asks with `recorder.ask`, so under a worker the run shows `input_required` with the
question until `deja answer RUN TEXT`; the answer is an observation, so a replay of the
cassette reproduces it without asking. The report it writes is declared with
`recorder.artefact`, so the signed cassette vouches for its content.
"""

from pathlib import Path

import recorder

invoice = {"id": "INV-7", "amount": "EUR 1,200", "vendor": "Acme Parts"}
answer = recorder.ask(f"Pay invoice {invoice['id']} ({invoice['amount']}, {invoice['vendor']})?")
paid = answer.strip().lower().startswith("y")
report = Path("reports") / f"approval-{invoice['id']}.txt"
report.parent.mkdir(exist_ok=True)
report.write_text(f"{invoice['id']}: {'paid' if paid else 'held'} (answer: {answer!r}) at "
                  f"{recorder.utcnow().isoformat(timespec='seconds')}\n")
recorder.artefact(report)
print(f"{invoice['id']}: {'paid' if paid else 'held'}; report {report}")
