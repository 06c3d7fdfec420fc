"""Fusion passes: recognise a subgraph (norms, attention, rotary, MatMul+Add) and replace it by one op."""
