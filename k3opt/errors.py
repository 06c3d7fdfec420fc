"""The k3opt exception hierarchy.

Library callers catch these; the CLI turns each into one line on stderr and
the exit code named by ``exit_code`` (2: unusable input or usage, 1: the
optimized model does not match the original, or does not load).
"""
from __future__ import annotations


class K3optError(Exception):
    """Base of every error k3opt raises on purpose."""

    exit_code = 2


class InputError(K3optError):
    """The model (or its external data) cannot be read or is not a valid graph."""


class UsageError(K3optError):
    """An option value is wrong: unknown pass, bad shape spec, bad target..."""


class OutputError(K3optError):
    """The output cannot be written where asked."""


class PluginError(K3optError):
    """A plugin failed to load, or one of its rules failed; names plugin and rule."""


class VerificationError(K3optError):
    """The optimized model's outputs differ from the original's beyond tolerance."""

    exit_code = 1


class UnverifiableError(K3optError):
    """Verification was asked for but cannot run (onnxruntime fails on the original at every size tried):
    nothing is written; ``--no-verify`` writes the model unverified."""


class InvalidOutputError(K3optError):
    """The optimized model, written, does not load (in onnxruntime, or under its target's checks).

    Raised before the output is renamed into place: nothing was written.
    """

    exit_code = 1


class CompileError(K3optError):
    """ATC (or the CANN bridge in front of it) failed."""

    exit_code = 1
