"""FX passes over the Dynamo (torch-IR) graph: see pipeline.PASSES for the list and order."""
from .context import Counters, LycheeCompileError, PassContext, Site  # noqa: F401
from .pipeline import PASSES, run_passes  # noqa: F401
