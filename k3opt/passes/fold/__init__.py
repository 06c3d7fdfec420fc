"""Folding passes: evaluate constant subgraphs and fold constant operands into the ops that use them."""
