"""Cleanup passes: remove no-op, dead and duplicate nodes, merge chains of like ops."""
