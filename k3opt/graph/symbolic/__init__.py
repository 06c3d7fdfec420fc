"""Symbolic shape reasoning: what is known of a graph's dims and of the small integer tensors computed from them.

``dims``: a dim is a number, a symbol (a ``dim_param``: equal names are equal sizes; canonical sums and products
such as ``batch * 7``) or unknown; dims are traced through their producers, and shape computations (``Shape``,
``Gather``, ``Concat``, arithmetic...) are evaluated element by element. ``input_dims``: the inputs' symbols
written into the shapes tracing proves them in, for a block. ``relations``: the equations a graph imposes between
its inputs' symbolic dims (what verification's input sizes must agree on).
"""
