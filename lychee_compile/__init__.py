"""lychee_compile: hybrid retrieval/sparse decode attention for any Hugging Face decoder, via torch.compile."""
from .config import LycheeConfig, LycheeConfigError  # noqa: F401
from .head_map import HeadMap, HeadMapError  # noqa: F401
from . import ops  # noqa: F401  (registers torch.ops.lychee.*)


def lychee_compile(model, head_map, config=None):
    from .api import lychee_compile as _impl
    return _impl(model, head_map, config)


__all__ = ["lychee_compile", "HeadMap", "LycheeConfig", "HeadMapError", "LycheeConfigError"]
