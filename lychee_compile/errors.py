"""Every error and warning class of lychee_compile. Each message names the problem and what to do instead.

    LycheeCompileError     the model cannot be rewritten or run as asked (attention forms, generation modes, masks)
    LycheeConfigError      a LycheeConfig value makes no sense, or does not fit this model / cache
    HeadMapError           a head map that cannot be used with this model
    HeadMapWarning         a head map that is used, but not entirely as written (forced or ignored rows)
    RealModelUnavailable   the packages that provide the real model (SmolLM2) are not installed
    MethodError            an evaluation method name or parameter that `lychee eval` does not know
    DenseFallback          an evaluation variant that should run the sparse path did not
    SparsityNotMeasured    the evaluation's sparsity collector did not see one op call per step and global layer
    NumericsUnavailable    an evaluation numerics this machine cannot run (the kernels without CUDA)
    KernelsNotRun          a variant evaluated on the kernels numerics whose decode sites ran the op's reference
"""
from __future__ import annotations


class LycheeCompileError(RuntimeError):
    """The model cannot be rewritten as asked; the message names the problem and what to do."""


class LycheeConfigError(ValueError):
    """A LycheeConfig value makes no sense; the message says which and what to use instead."""


class HeadMapError(ValueError):
    """A head map that cannot be used with this model; the message says what is wrong and how to fix it."""


class HeadMapWarning(UserWarning):
    """A head map that is used, but not entirely as written (the message says which rows and why)."""


class RealModelUnavailable(RuntimeError):
    """The packages that provide the real model are not installed; the message says which pip command to run."""


class TokenizerRefused(RealModelUnavailable):
    """A real model's tokenizer cannot be used (a broken conversion, a folder without one, another vocabulary than
    the model's); the message says where it came from and what to do."""


class MethodError(ValueError):
    """An evaluation method name or parameter that `lychee eval` does not know."""


class DenseFallback(RuntimeError):
    """A variant that should run the sparse path did not (no rewritten graph, or a graph left dense)."""


class SparsityNotMeasured(RuntimeError):
    """The sparsity collector did not see exactly one op call per decode step and global layer."""


class NumericsUnavailable(RuntimeError):
    """An evaluation numerics this machine cannot run (the Triton kernels need a CUDA GPU)."""


class KernelsNotRun(RuntimeError):
    """A variant evaluated on the kernels numerics whose rewritten sites did not all run the Triton kernels."""


def lychee_error_inside(exc: BaseException) -> BaseException:
    """Our error that Dynamo wrapped (BackendCompilerFailed and its causes) when a backend raised it, else exc."""
    inner = exc
    while inner is not None and not isinstance(inner, (LycheeCompileError, HeadMapError, LycheeConfigError)):
        inner = inner.__cause__ or getattr(inner, "inner_exception", None)
    return inner if inner is not None else exc
