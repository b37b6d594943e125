"""LSH — SimHash tables, MagicPIG-style (Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation",
ICLR 2025).

K·L random Gaussian hyperplanes hash every key into L tables of K sign bits each; keys are centred first (their mean
over the clusterable region is subtracted, which shifts every logit of a query by the same amount and leaves the
softmax unchanged). A token is a *candidate* when it shares the query's bucket in at least ``min_collisions`` (2) of
the L tables (MagicPIG's rule).

Two uses:
- as a ranking (``score``): candidates first, then by the number of tables they collide in, ties broken by the
  agreement over all K·L bits (the SimHash angle estimate). A ranking, not a logit estimate.
- as a sampling pool (``sample_pool``, for ``tail: sample``): the candidates, with the probability each one had of
  becoming a candidate, p_i = P(Binomial(L, u_i^K) ≥ min_collisions), u_i = 1 − θ_i/π, θ_i the angle between q and
  the centred key. The pipeline weights a drawn token by 1/p_i (MagicPIG adds −ln p_i to the logit).

With K = 0 every key lands in the query's bucket in every table: every token is a candidate with p = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from oa_core import hookimpl
from oa_core.components import Clusters, Selector


class LSHConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    K: int = Field(default=10, ge=0, le=62, description="bits (hyperplanes) per table")
    L: int = Field(default=150, ge=1, description="hash tables")
    min_collisions: int = Field(
        default=2, ge=1, description="tables a key must share with the query to be a candidate (MagicPIG: 2)"
    )
    center: bool = Field(default=True, description="subtract the keys' mean before hashing (MagicPIG)")


@dataclass
class LSHIndex:
    planes: Tensor  # [Hkv, D, L·K] float32, table t uses columns [tK, (t+1)K)
    center: Tensor  # [B, Hkv, 1, D] float32 (zeros when not centring)
    buckets: Tensor  # [B, Hkv, N, L]: table t's K sign bits as one integer (bit k: hyperplane tK + k)


class SimHashSelector(Selector):
    """SimHash LSH (K bits × L tables), MagicPIG's candidate rule and collision probabilities."""

    name = "lsh"
    Config = LSHConfig
    config: LSHConfig

    def build(
        self, keys: Tensor, queries: Tensor | None, clusters: Clusters, generator: torch.Generator | None = None
    ) -> LSHIndex:
        B, Hkv, N, D = keys.shape
        K, L = self.config.K, self.config.L
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        planes = torch.randn(Hkv, D, L * K, generator=generator).to(keys.device)
        center = keys.new_zeros(B, Hkv, 1, D, dtype=torch.float32)
        if self.config.center:
            region = (clusters.assignment < clusters.num_clusters).unsqueeze(-1)  # [B, Hkv, N, 1]
            total = (keys.float() * region).sum(2, keepdim=True)
            center = total / region.sum(2, keepdim=True).clamp_min(1)
        index = LSHIndex(planes, center, keys.new_zeros(B, Hkv, 0, L, dtype=_bucket_dtype(K)))
        return self.extend(index, keys)

    def scoring_bytes(self, head_dim: int) -> float:
        return self.config.K * self.config.L / 8  # K·L sign bits

    def token_codes(self, index: LSHIndex, keys: Tensor) -> dict[str, Tensor]:
        return {"buckets": self._hash(index, keys.float() - index.center)}

    def _hash(self, index: LSHIndex, vectors: Tensor) -> Tensor:
        """``[B, Hkv, n, D]`` → each table's bucket ``[B, Hkv, n, L]``, the smallest integer type that holds K bits.
        The hyperplanes go in chunks of tables: the build's ``[.., N, tables, K]`` temporary stays bounded (one
        chunk for a decode step's few rows)."""
        K, L = self.config.K, self.config.L
        powers = 2 ** torch.arange(K, device=vectors.device)
        buckets = []
        for tables in _chunks(L, vectors[..., 0].numel() * max(K, 1)):
            bits = (vectors @ index.planes[:, :, tables.start * K : tables.stop * K].unsqueeze(0)) > 0
            per_table = bits.view(*bits.shape[:-1], tables.stop - tables.start, K)
            buckets.append((per_table.long() * powers).sum(-1).to(_bucket_dtype(K)))
        return torch.cat(buckets, -1)

    def _collisions(self, query: Tensor, index: LSHIndex, agreement: bool = True) -> tuple[Tensor, Tensor | None]:
        """query ``[B, Hkv, Gs, G, T, D]`` → (tables shared with each key, bits agreeing with each key or None if
        not ``agreement``), both ``[B, Hkv, g·T, N]`` (rows: head, query). A bucket holds its table's K bits, so both
        come from the buckets: a table is shared where the two buckets are equal, and the bits agreeing are counted by
        ``_bits_agreeing``."""
        B, Hkv, Gs, G, T, D = query.shape
        K, N = self.config.K, index.buckets.shape[2]
        q = query.float().reshape(B, Hkv, Gs * G * T, D)
        q_buckets = self._hash(index, q)  # centring only shifts q·k: the query is hashed as it is
        R, parts = q.shape[2], _bytes(K)
        collisions = q.new_zeros(B, Hkv, R, N)
        agree = torch.zeros_like(collisions) if agreement else None
        for tables in _chunks(self.config.L, B * Hkv * max(R * N, N * parts, R * parts * 256)):
            collisions += (q_buckets[..., None, tables] == index.buckets[:, :, None, :, tables]).sum(-1)
            if agreement and K:
                assert agree is not None
                agree += _bits_agreeing(q_buckets[..., tables], index.buckets[..., tables], K)
        return collisions, agree

    def score(self, query: Tensor, index: LSHIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, _ = query.shape
        collisions, agree = self._collisions(query, index)
        assert agree is not None  # counted by default
        bits = max(self.config.K * self.config.L, 1)
        candidate = collisions >= self.config.min_collisions
        # Lexicographic: candidate, then tables shared (0..L), then bits agreeing (a fraction below 1).
        ranking = candidate * (self.config.L + 1.0) + collisions + agree / (bits + 1)
        return ranking.view(B, Hkv, Gs, G, T, -1).amax(3)

    def sample_pool(self, query: Tensor, index: LSHIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hkv, Gs, G, T, D = query.shape
        collisions, _ = self._collisions(query, index, agreement=False)
        # The probability a key had of becoming a candidate, from its exact angle to the query. A reference: a
        # kernel computes it only for the rows it draws, which it reads anyway.
        q = query.double().reshape(B, Hkv, Gs * G * T, D)
        k = keys.double() - index.center.double()
        cosine = (q @ k.transpose(-1, -2)) / (q.norm(dim=-1, keepdim=True) * k.norm(dim=-1).unsqueeze(-2)).clamp_min(
            1e-30
        )
        candidate = collisions >= self.config.min_collisions
        theta = torch.arccos(cosine[candidate].clamp(-1, 1))
        log_p = torch.full(collisions.shape, -math.inf, dtype=torch.float64, device=query.device)
        log_p[candidate] = log_candidate_probability(
            1 - theta / math.pi, self.config.K, self.config.L, self.config.min_collisions
        )
        return log_p.float().view(B, Hkv, Gs, G, T, -1)


CHUNK_ELEMENTS = 1 << 26  # what one chunk may hold in a temporary: 64M elements (256 MB of float)


def _chunks(count: int, per_item: int) -> list[slice]:
    """``range(count)`` (tables, rows) in chunks whose temporaries (``per_item`` elements each) stay within
    CHUNK_ELEMENTS."""
    size = max(1, CHUNK_ELEMENTS // max(per_item, 1))
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def _bucket_dtype(K: int) -> torch.dtype:
    return torch.int16 if K <= 15 else torch.int32 if K <= 31 else torch.int64


def _bytes(K: int) -> int:
    return (K + 7) // 8


def _bits_agreeing(q_buckets: Tensor, buckets: Tensor, K: int) -> Tensor:
    """Σ over the tables of the bits that a query's and a key's buckets share, K − popcount(q ⊕ k): query buckets
    ``[B, Hkv, R, t]``, key buckets ``[B, Hkv, N, t]`` → ``[B, Hkv, R, N]``.

    Without expanding the keys' K·t bits: each bucket is cut into bytes; for every query, table and byte, a
    256-entry table holds the bits shared with each possible key byte; one embedding bag then sums, for every key,
    the entries its bytes pick (all R queries at once, one column each)."""
    B, Hkv, R, t = q_buckets.shape
    N, parts, device = buckets.shape[2], _bytes(K), buckets.device
    shifts = 8 * torch.arange(parts, dtype=torch.int32, device=device)
    width = (K - shifts).clamp(max=8)  # the bits in each byte
    byte = torch.arange(256, dtype=torch.int32, device=device)
    popcount = ((byte[:, None] >> torch.arange(8, device=device)) & 1).sum(-1)  # [256]
    q_bytes = (q_buckets.int()[..., None] >> shifts) & 255  # [B, Hkv, R, t, parts]
    shared = width[:, None] - popcount[(byte ^ q_bytes[..., None]).long()]  # [B, Hkv, R, t, parts, 256]
    weight = shared.permute(0, 1, 3, 4, 5, 2).reshape(-1, R).float()  # row: (b, h, table, byte, key byte)
    k_bytes = (buckets.int()[..., None] >> shifts) & 255  # [B, Hkv, N, t, parts]
    first = 256 * torch.arange(B * Hkv * t * parts, dtype=torch.int32, device=device).view(B, Hkv, 1, t, parts)
    summed = torch.nn.functional.embedding_bag((k_bytes + first).view(B * Hkv * N, t * parts), weight, mode="sum")
    return summed.view(B, Hkv, N, R).transpose(-1, -2)


def log_candidate_probability(u: Tensor, K: int, L: int, min_collisions: int) -> Tensor:
    """ln P(Binomial(L, u^K) ≥ c): the chance that a key whose sign bits each agree with the query's with probability
    u collides with it in at least c of L tables of K bits. float64; −inf where it is 0.

    The upper tail's terms j = c..L summed at once in log space (no 1 − Σ cancellation: a candidate of probability
    1e-20 gets its weight 1e20, not infinity)."""
    u = u.double()
    log_hit = K * torch.log(u)  # ln u^K, per table
    log_miss = torch.log1p(-torch.exp(log_hit).clamp_max(1.0))  # ln(1 − u^K); −inf when u = 1
    j = torch.arange(min_collisions, L + 1, dtype=torch.float64, device=u.device)
    choose = torch.tensor(
        [
            math.lgamma(L + 1) - math.lgamma(i + 1) - math.lgamma(L - i + 1)  # ln C(L, j), exactly 0
            for i in range(min_collisions, L + 1)
        ],
        dtype=torch.float64,
        device=u.device,
    )  # at j = L
    total = torch.empty_like(log_hit).view(-1)
    log_hit, log_miss = log_hit.reshape(-1, 1), log_miss.reshape(-1, 1)
    for rows in _chunks(total.numel(), max(len(j), 1)):
        miss = torch.where(j < L, (L - j) * log_miss[rows], 0.0)  # 0·ln 0 = 0: every table hit
        total[rows] = torch.logsumexp(choose + j * log_hit[rows] + miss, -1)  # −inf when no term (c > L)
    return total.view(u.shape)


@hookimpl
def register_selectors(register):
    register(SimHashSelector)
