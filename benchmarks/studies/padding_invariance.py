"""Is the model's own attention batch-invariant under left padding? Greedy answers of a small random Llama, each
prompt alone vs in a left-padded batch, with its own sdpa and with OpenAttention (a covering budget and a sparse one),
per dtype. A reference for reading the padding checks of cuda_consistency.py. Prints JSON lines."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import oa_core as oa


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config).eval().to(device, dtype)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 256, (1, n), generator=gen).to(device) for n in (700, 1000)]
        ids = torch.zeros(2, 1000, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, -p.shape[1] :], mask[row, -p.shape[1] :] = p[0], 1

        def greedy(x, m=None, model=model):
            with torch.no_grad():
                out = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x) if m is None else m,
                    max_new_tokens=16,
                    do_sample=False,
                    pad_token_id=0,
                )
            return out[:, x.shape[1] :]

        def invariant(prompts=prompts, ids=ids, mask=mask) -> bool:
            alone = [greedy(p) for p in prompts]
            batched = greedy(ids, mask)
            return all(torch.equal(batched[row], alone[row][0]) for row in range(2))

        result = {"device": device, "dtype": str(dtype), "sdpa": invariant()}
        for name, spec in (
            ("openattention covering budget", {"budget": {"tokens": 100_000}}),
            (
                "openattention 10%",
                {"clusterer": {"name": "qgc", "num_clusters": 16}, "sink": 4, "local": 16, "budget": {"density": 0.1}},
            ),
        ):
            with oa.patch(model, spec):
                result[name] = invariant()
        print(json.dumps(result))


if __name__ == "__main__":
    main()
