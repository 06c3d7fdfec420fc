"""The fast import moves the new graph to the collector's oldest generation without disturbing the process."""
from __future__ import annotations

import gc

from k3opt.graph import gs_import
from tests.test_fast_edges import _kitchen_sink


def test_objects_the_process_froze_stay_frozen():
    """gc.unfreeze() would release them too: with frozen objects the import promotes by a collection."""
    mine = [[] for _ in range(3)]
    gc.freeze()
    try:
        graph = gs_import.import_onnx(_kitchen_sink())
        tracked = {id(o) for o in gc.get_objects()}  # the generations, not the frozen
        assert not any(id(o) in tracked for o in mine)
        oldest = {id(o) for o in gc.get_objects(generation=2)}
        assert id(graph) in oldest and all(id(n) in oldest for n in graph.nodes)
    finally:
        gc.unfreeze()


def test_nothing_is_left_frozen():
    gs_import.import_onnx(_kitchen_sink())
    assert gc.get_freeze_count() == 0
