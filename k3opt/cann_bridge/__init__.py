"""k3opt.cann_bridge (see docs/design.md)."""
