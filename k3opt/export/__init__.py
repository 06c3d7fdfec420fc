"""k3opt.export (see docs/design.md)."""
