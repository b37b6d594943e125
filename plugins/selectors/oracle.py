"""Oracle selector: exact logits s·q·k_i. An upper bound for experiments (it reads every key to choose), never a
default."""

from __future__ import annotations

from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Selector
from oa_core.ops.rerank import exact_logits


class OracleSelector(Selector):
    """Exact logits: the best any selector can do."""

    name = "oracle"

    def scoring_bytes(self, head_dim: int) -> float:
        return 2 * head_dim  # the key itself, in bf16

    def token_codes(self, index: None, keys: Tensor) -> dict[str, Tensor]:
        return {}  # it reads the keys themselves

    def score(self, query: Tensor, index: None, keys: Tensor, scale: float) -> Tensor:
        return exact_logits(query, keys, scale)


@hookimpl
def register_selectors(register):
    register(OracleSelector)
