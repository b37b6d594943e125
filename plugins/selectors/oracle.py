"""Oracle selector: exact logits s·q·k_i. An upper bound for experiments (it reads every key to choose), never a
default."""

from __future__ import annotations

from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Selector


class OracleSelector(Selector):
    """Exact logits: the best any selector can do."""

    name = "oracle"

    def token_codes(self, index: None, keys: Tensor) -> dict[str, Tensor]:
        return {}  # it reads the keys themselves

    def score(self, query: Tensor, index: None, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, D = query.shape
        logits = scale * query.float().reshape(B, Hkv, -1, D) @ keys.float().transpose(-1, -2)
        return logits.view(B, Hkv, Gs, G, T, -1).amax(3)


@hookimpl
def register_selectors(register):
    register(OracleSelector)
