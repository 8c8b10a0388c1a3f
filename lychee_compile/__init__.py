"""lychee_compile: hybrid retrieval/sparse decode attention for any Hugging Face decoder, via torch.compile."""
from .config import KernelOptions, LycheeConfig  # noqa: F401
from .errors import HeadMapError, LycheeCompileError, LycheeConfigError  # noqa: F401
from .head_map import HeadMap  # noqa: F401
from . import ops  # noqa: F401  (registers torch.ops.lychee.*)


def lychee_compile(model, head_map, config=None):
    from .api import lychee_compile as _impl
    return _impl(model, head_map, config)


def set_head_map(model, head_map):
    """Swap a compiled model's head map in place (no recompile); see api.set_head_map."""
    from .api import set_head_map as _impl
    return _impl(model, head_map)


__all__ = ["lychee_compile", "set_head_map", "HeadMap", "LycheeConfig", "KernelOptions", "HeadMapError",
           "LycheeConfigError", "LycheeCompileError"]
