"""Oracle selector: exact logits s·q·k_i. An upper bound for experiments (it reads every key to choose), never a
default."""

from __future__ import annotations

from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Selector


class OracleSelector(Selector):
    """Exact logits: the best any selector can do."""

    name = "oracle"

    def score(self, query: Tensor, index: None, keys: Tensor, scale: float) -> Tensor:
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        q = query.float().reshape(B, Hkv, Hq // Hkv * T, D)
        return (scale * q @ keys.float().transpose(-1, -2)).view(B, Hq, T, -1)


@hookimpl
def register_selectors(register):
    register(OracleSelector)
