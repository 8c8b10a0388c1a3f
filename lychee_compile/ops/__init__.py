"""Op schemas (torch.library, namespace `lychee`), fake implementations and eager references."""
# registers lychee::select_rows, index_ready, hybrid_decode_heat, hybrid_decode_quest, bind_state, write_state,
# one_shot_all_reduce
from . import deferred_select, heat, one_shot_all_reduce, quest_decode, state  # noqa: F401
from .dense_decode import dense_decode, dense_decode_reference, segment_plan, valid_ranges  # noqa: F401  (lychee:: ops)
from .hybrid_decode import hybrid_decode, hybrid_decode_op  # noqa: F401  (registers the op)
from .index_state import EMPTY, INDEX_DTYPE, empty_index_state  # noqa: F401
from .reference import hybrid_decode_reference  # noqa: F401
