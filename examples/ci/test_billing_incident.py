"""Incident 4312, recorded in production and committed: replayed offline on every push
(docs/ci.md). record=False: no record mode ever overwrites it."""

import pytest
from billing_agent import main


@pytest.mark.deja("examples/ci/incidents/billing-4312.jsonl", record=False,
                  normalise=["[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE"])  # today's date in the prompt
def test_incident_4312() -> None:
    assert "INV-7" in main()
