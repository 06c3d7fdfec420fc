"""The pattern API for fusion rules (see docs/design.md, docs/writing-rules.md)."""
