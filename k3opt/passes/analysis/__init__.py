"""Analyses several passes share: the dim analysis (fold_shapes) traces symbolic dims and small shape values."""
