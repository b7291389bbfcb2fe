"""Loading a transformers checkpoint for ``measure`` / ``compare``, composite (vision-language) MoEs included.

A checkpoint whose config ``AutoModelForCausalLM`` does not map (Qwen3-VL-MoE, GLM-4.5V, Mistral 4, ...) is
loaded with the class ``AutoModelForImageTextToText`` maps it to; a gate then runs its text model alone
(``input_ids`` only, the vision tower idle), and the routed layers found are the text model's MoE blocks.
Transformers is imported here, never by the engine's other modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_tracking.cli.common import CLIError

UNMAPPED = "Unrecognized configuration class"
"""What transformers' auto classes say about a config they do not map."""


def from_pretrained(path: Path, dtype: Any) -> Any:
    """A causal LM, else a composite model whose text path is one, loaded from ``path`` (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    except ValueError as exc:
        if UNMAPPED not in str(exc):
            raise
        first = str(exc).splitlines()[0]
    try:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, use_safetensors=True)
    except ValueError as exc:
        if UNMAPPED not in str(exc):
            raise
        raise ValueError(f"{path}: neither a causal LM nor a composite model with a text model ({first})") from None


def load_hf_model(model_dir: str, dtype: str = "auto", device: str = "cpu"):
    """Load a transformers causal LM (or a composite model, measured through its text model) from a local
    checkpoint directory (safetensors weights)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise CLIError(f"loading --model needs transformers (pip install 'atlas-tracking[hf]'): {exc}") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise CLIError(f"{model_dir} is not a transformers checkpoint directory (no config.json)")
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return from_pretrained(path, torch_dtype).to(device).eval()
