"""The main job on embedded defaults: measure the atlas receipts of a small MoE on real text.

Run with ``make demo``. Builds a small Qwen3-MoE from a transformers config (random weights:
nothing is downloaded), makes a canary from English prose that ships with Python, measures
every routed layer, prints the per-layer table, and writes ``out/demo/receipts.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_data import VOCAB_SIZE, encode, prose_text

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.tables import layer_table, summary_line


def build_model(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=True,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


def main(out_dir: str = "out/demo") -> int:
    out = Path(out_dir)
    model = build_model()
    canary = Canary.from_token_ids(encode(prose_text()), window=128, n_windows=32, seed=0)
    config = AtlasConfig()
    t0 = time.perf_counter()
    report = measure(model, canary, config=config, step=0)
    t_gate = time.perf_counter() - t0
    ids = torch.from_numpy(canary.windows)
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, canary.n_windows, config.receipts.batch_windows):
            model(input_ids=ids[s : s + config.receipts.batch_windows], use_cache=False)
    t_plain = time.perf_counter() - t0
    report.save(out / "receipts.json")
    canary.save(out / "canary.npz")
    print(layer_table(report.layers))
    print(summary_line(report.summary))
    print(f"gate {t_gate:.3f}s vs plain no-grad forward {t_plain:.3f}s over {canary.n_tokens} canary tokens")
    print(f"wrote {out / 'receipts.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
