"""Reading and writing models without loading their weights.

Inside k3opt every external-data ``location`` is an ABSOLUTE path (see
docs/design.md, "External data"): :func:`load` resolves the locations of a
model file against its folder, so a model proto can travel through the
pipeline (and through temporary spill files) without a base directory.
:class:`ExternalValues` reads such a tensor lazily for gs, :func:`save`
streams it into the output's data file chunk by chunk.

Modules by job: ``loading`` (read and import), ``validation`` (well-formed
input), ``constant_nodes`` (literals lifted into initializers before the
import), ``external`` (external-data tensors), ``spill`` and ``spill_regions``
(weights created during the run), ``concat_values`` (merged weights, written
only when saved), ``output_paths`` (what may be written, checked first), ``saving`` (atomic save),
``temp_folders`` (its private folders, and those of dead runs), ``data_location`` and
``direct_io`` (their file-system helpers).
"""
from .constant_nodes import lift_constant_nodes
from .external import (EXTERNAL_THRESHOLD, ExternalValues, PathLike, all_tensors, external_info,
                       external_tensor, inline_copy, is_weight, read_external_bytes, tensor_nbytes,
                       weights_as_inputs)
from .exporting import export_graph
from .loading import Loaded, import_graph, load, read_model
from .output_paths import check_output_path, check_outputs, data_path
from .repair import input_checker_fault, repair
from .saving import PROTO_LIMIT, inline_size, proto_size, save
from .spill import SPILL_PREFIX, spill_constant
from .spill_regions import defer_spill, deferred_regions, forget_deferred, materialize, materialize_all
from .validation import MAX_GRAPH_DEPTH, check_graph, validate

__all__ = ["EXTERNAL_THRESHOLD", "MAX_GRAPH_DEPTH", "PROTO_LIMIT", "SPILL_PREFIX", "ExternalValues", "Loaded",
           "PathLike", "all_tensors", "check_graph", "check_output_path", "check_outputs", "data_path", "defer_spill",
           "deferred_regions", "export_graph", "external_info", "external_tensor", "forget_deferred", "import_graph", "inline_copy",
           "inline_size", "input_checker_fault", "is_weight", "lift_constant_nodes", "load", "materialize", "materialize_all", "proto_size",
           "read_external_bytes", "repair", "read_model", "save", "spill_constant", "tensor_nbytes", "validate",
           "weights_as_inputs"]
