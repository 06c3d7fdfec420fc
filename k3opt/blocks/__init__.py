"""Cutting a transformer at its layer boundaries: block-by-block verification and pipeline stages.

``structure`` finds the boundaries and the blocks, ``plan`` groups blocks (under a memory budget, or
into balanced stages), ``graph_index`` builds a block's model, ``session`` runs one with its weights
streamed from external data, ``verify`` compares an original and an optimized model block by block,
``split`` writes pipeline stages and their manifest.
"""
