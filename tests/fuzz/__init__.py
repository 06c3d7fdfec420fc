"""Fuzzing k3opt's promises (issue #26, "make it stay fixed"): seed models, mutators at the protobuf level
(bit flips, truncations, splices), the graph level (names, ops, attributes, types, dims, opsets) and the
external-data level (locations, offsets, lengths, links, devices), and the properties every run must keep
(docs/cli.md "Guarantees"). tests/test_fuzz_inputs.py and tests/test_fuzz_cli.py run them for a budget of
seconds; bench/fuzz_cli_campaign.py for as long as asked.
"""
