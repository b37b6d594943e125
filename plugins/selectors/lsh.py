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
    min_collisions: int = Field(default=2, ge=1, description="tables a key must share with the query to be a "
                                                             "candidate (MagicPIG: 2)")
    center: bool = Field(default=True, description="subtract the keys' mean before hashing (MagicPIG)")


@dataclass
class LSHIndex:
    planes: Tensor  # [Hkv, D, L·K] float32, table t uses columns [tK, (t+1)K)
    center: Tensor  # [B, Hkv, 1, D] float32 (zeros when not centring)
    codes: Tensor  # [B, Hkv, N, ⌈L·K/8⌉] uint8: the L·K sign bits, packed (``unpack`` gives them back)
    buckets: Tensor  # [B, Hkv, N, L] the smallest integer type that holds K bits


class SimHashSelector(Selector):
    """SimHash LSH (K bits × L tables), MagicPIG's candidate rule and collision probabilities."""

    name = "lsh"
    Config = LSHConfig

    def build(self, keys: Tensor, queries: Tensor | None, clusters: Clusters,
              generator: torch.Generator | None = None) -> LSHIndex:
        B, Hkv, N, D = keys.shape
        K, L = self.config.K, self.config.L
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        planes = torch.randn(Hkv, D, L * K, generator=generator).to(keys.device)
        center = keys.new_zeros(B, Hkv, 1, D, dtype=torch.float32)
        if self.config.center:
            region = (clusters.assignment < clusters.num_clusters).unsqueeze(-1)  # [B, Hkv, N, 1]
            total = (keys.float() * region).sum(2, keepdim=True)
            center = total / region.sum(2, keepdim=True).clamp_min(1)
        index = LSHIndex(planes, center, keys.new_zeros(B, Hkv, 0, -(-L * K // 8), dtype=torch.uint8),
                         keys.new_zeros(B, Hkv, 0, L, dtype=_bucket_dtype(K)))
        return self.extend(index, keys)

    def extend(self, index: LSHIndex, keys: Tensor) -> LSHIndex:
        codes, buckets = self._hash(index, keys.float() - index.center)
        return LSHIndex(index.planes, index.center, torch.cat([index.codes, codes], 2),
                        torch.cat([index.buckets, buckets], 2))

    def _hash(self, index: LSHIndex, vectors: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, Hkv, n, D]`` → (sign bits, packed, ``[B, Hkv, n, ⌈L·K/8⌉]``; bucket per table ``[B, Hkv, n, L]``),
        a few tables at a time: no temporary grows with L·K (at 8 × 4K keys and L·K = 1500 bits one was several GB,
        and the index of 30 layers held 8 GB)."""
        K, L = self.config.K, self.config.L
        codes, buckets = [], []
        for tables in _table_chunks(L):
            bits = (vectors @ index.planes[:, :, tables.start * K:tables.stop * K].unsqueeze(0)) > 0
            per_table = bits.view(*bits.shape[:-1], tables.stop - tables.start, K)
            bucket = vectors.new_zeros(per_table.shape[:-1], dtype=torch.long)
            for bit in range(K):
                bucket |= per_table[..., bit].long() << bit
            codes.append(_pack(bits))  # 16·K bits, whole bytes: the chunks' codes line up
            buckets.append(bucket.to(_bucket_dtype(K)))
        return torch.cat(codes, -1), torch.cat(buckets, -1)

    def _collisions(self, query: Tensor, index: LSHIndex) -> tuple[Tensor, Tensor]:
        """query ``[B, Hq, T, D]`` → (tables shared with each key, bits agreeing with each key), both
        ``[B, Hkv, g·T, N]``, counted a few tables at a time."""
        B, Hq, T, D = query.shape
        K, Hkv = self.config.K, index.planes.shape[0]
        q = query.float().reshape(B, Hkv, Hq // Hkv * T, D)
        q_codes, q_buckets = self._hash(index, q)  # centring only shifts q·k: the query is hashed as it is
        collisions = q.new_zeros(B, Hkv, q.shape[2], index.buckets.shape[2])
        agree = torch.zeros_like(collisions)
        for tables in _table_chunks(self.config.L):
            same = q_buckets[..., None, tables] == index.buckets[:, :, None, :, tables]
            collisions += same.sum(-1)
            bits = (tables.stop - tables.start) * K
            chunk = slice(tables.start * K // 8, -(-tables.stop * K // 8))  # 16·K bits a chunk: whole bytes
            # Agreement over the chunk's bits from ±1 codes: (bits + Σ ±1·±1) / 2.
            q_sign, k_sign = (2 * unpack(c[..., chunk], bits).float() - 1 for c in (q_codes, index.codes))
            agree += (bits + q_sign @ k_sign.transpose(-1, -2)) / 2
        return collisions, agree

    def score(self, query: Tensor, index: LSHIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hq, T, _ = query.shape
        collisions, agree = self._collisions(query, index)
        bits = max(self.config.K * self.config.L, 1)
        candidate = collisions >= self.config.min_collisions
        # Lexicographic: candidate, then tables shared (0..L), then bits agreeing (a fraction below 1).
        ranking = candidate * (self.config.L + 1.0) + collisions + agree / (bits + 1)
        return ranking.view(B, Hq, T, -1)

    def sample_pool(self, query: Tensor, index: LSHIndex, keys: Tensor, scale: float) -> Tensor:
        B, Hq, T, D = query.shape
        Hkv = keys.shape[1]
        collisions, _ = self._collisions(query, index)
        # The probability a key had of becoming a candidate, from its exact angle to the query. A reference: a
        # kernel computes it only for the rows it draws, which it reads anyway.
        q = query.double().reshape(B, Hkv, Hq // Hkv * T, D)
        k = keys.double() - index.center.double()
        cosine = (q @ k.transpose(-1, -2)) / (q.norm(dim=-1, keepdim=True) * k.norm(dim=-1).unsqueeze(-2)).clamp_min(
            1e-30)
        candidate = collisions >= self.config.min_collisions
        theta = torch.arccos(cosine[candidate].clamp(-1, 1))
        log_p = torch.full(collisions.shape, -math.inf, dtype=torch.float64, device=query.device)
        log_p[candidate] = log_candidate_probability(1 - theta / math.pi, self.config.K, self.config.L,
                                                     self.config.min_collisions)
        return log_p.float().view(B, Hq, T, -1)


def _table_chunks(tables: int, size: int = 16) -> list[slice]:
    """The L tables in chunks of ``size``: what bounds every per-table temporary."""
    return [slice(start, min(start + size, tables)) for start in range(0, tables, size)]


def _bucket_dtype(K: int) -> torch.dtype:
    return torch.int16 if K <= 15 else torch.int32 if K <= 31 else torch.int64


def _pack(bits: Tensor) -> Tensor:
    """bool ``[..., n]`` → uint8 ``[..., ⌈n/8⌉]``: bit i of byte j is bit 8j + i (0 past n)."""
    pad = -bits.shape[-1] % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], pad)], -1)
    weights = 2 ** torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(*bits.shape[:-1], -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack(codes: Tensor, bits: int) -> Tensor:
    """The inverse of packing: uint8 ``[..., ⌈bits/8⌉]`` → bool ``[..., bits]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return ((codes[..., None] >> shifts) & 1).bool().flatten(-2)[..., :bits]


def log_candidate_probability(u: Tensor, K: int, L: int, min_collisions: int) -> Tensor:
    """ln P(Binomial(L, u^K) ≥ c): the chance that a key whose sign bits each agree with the query's with probability
    u collides with it in at least c of L tables of K bits. float64; −inf where it is 0.

    Summed over the upper tail j = c..L in log space (no 1 − Σ cancellation: a candidate of probability 1e-20 gets
    its weight 1e20, not infinity)."""
    u = u.double()
    log_hit = K * torch.log(u)  # ln u^K, per table
    log_miss = torch.log1p(-torch.exp(log_hit).clamp_max(1.0))  # ln(1 − u^K); −inf when u = 1
    total = torch.full_like(u, -math.inf)
    for j in range(min_collisions, L + 1):
        choose = math.lgamma(L + 1) - math.lgamma(j + 1) - math.lgamma(L - j + 1)
        miss = (L - j) * log_miss if j < L else torch.zeros_like(u)  # 0·ln 0 = 0: every table hit
        total = torch.logaddexp(total, choose + j * log_hit + miss)
    return total


@hookimpl
def register_selectors(register):
    register(SimHashSelector)
