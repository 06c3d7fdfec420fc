"""Pieces more than one capability's passes use (a pass never imports another pass's module).

``op_kinds`` (facts about op types: the random ops, a Transpose's permutation), ``shape_refs`` (a small
shape tensor element by element).
"""
