"""Symbolic shape reasoning, once for every pass: what is known of a graph's dims and of the small integer
tensors computed from them.

- ``algebra``: dims as symbols (a ``dim_param``; canonical sums, products and quotients of sizes).
- ``dims``: :class:`~.dims.Dims`, the object a pass asks (``dims.at(t, i)``, ``dims.elements(t)``,
  ``dims.fold(node)``); the run hands one out per graph (``ctx.dims(graph)``).
- ``trace``: a dim from its producer (one tracer per op); ``values``: shape values element by element
  (one evaluator per op) and folding ``Shape``/``Size``/``Gather``/``Slice``/``Equal`` of them.
- ``memo``: what a ``Dims`` remembers, and forgets after an edit.
- ``input_dims``: the inputs' symbols written into the shapes tracing proves them in, for a block.
- ``relations``: the equations a graph (a ModelProto's) imposes between its inputs' symbolic dims: what
  verification's input sizes must agree on.
"""
