"""FX passes over the Dynamo (torch-IR) graph: see pipeline.PASSES for the list and order."""
from ..errors import LycheeCompileError  # noqa: F401
from .context import Counters, PassContext, Site  # noqa: F401
from .pipeline import PASSES, run_passes  # noqa: F401
