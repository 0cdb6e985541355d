"""Test-only helpers shared by the unit, integration and e2e tests (never shipped)."""
