"""The canary: a fixed, deterministic set of token windows, its fingerprint, and sharding over ranks.

Example:
    >>> import numpy as np
    >>> c = Canary.from_token_ids(np.arange(1000), window=16, n_windows=4, seed=0)
    >>> c.windows.shape, c.n_tokens
    ((4, 16), 64)
    >>> c == Canary.from_token_ids(np.arange(1000), window=16, n_windows=4, seed=0)
    True
    >>> [list(range(*b)) for b in c.shard(rank=1, world_size=2, batch_windows=1)]
    [[1], [3]]
    >>> Canary.coerce(None)
    Traceback (most recent call last):
    ...
    atlas_tracking.engine.canary.CanaryError: canary must be a Canary, a [n_windows, window] array of token ids, or the path of a saved canary (.npz/.npy); got None
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.artifacts.io import write_atomic


class CanaryError(ValueError):
    """The canary is empty, malformed, or does not fit the model."""


@dataclass(eq=False)
class Canary:
    """``n_windows`` token windows of length ``window`` (an int64 array ``[n_windows, window]``)."""

    windows: np.ndarray
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Start offset of each window in the source stream (empty when windows were given directly)."""
    seed: int | None = None

    def __post_init__(self) -> None:
        w = np.asarray(self.windows)
        if w.ndim != 2:
            raise CanaryError(f"canary windows must be a 2-D array [n_windows, window], got shape {w.shape}")
        if w.size == 0:
            raise CanaryError("canary is empty: it needs at least one window of at least two tokens")
        if w.shape[1] < 2:
            raise CanaryError(f"canary windows need at least two tokens (next-token NLL), got length {w.shape[1]}")
        if not np.issubdtype(w.dtype, np.integer):
            raise CanaryError(f"canary token ids must be integers, got dtype {w.dtype}")
        if (w < 0).any():
            raise CanaryError(f"canary holds negative token ids (min {int(w.min())})")
        self.windows = np.ascontiguousarray(w, dtype=np.int64)
        self.offsets = np.asarray(self.offsets, dtype=np.int64)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_token_ids(cls, ids, window: int, n_windows: int, seed: int = 0) -> Canary:
        """Choose ``n_windows`` non-overlapping windows of ``window`` tokens from a 1-D id stream (seeded)."""
        stream = np.asarray(ids).reshape(-1)
        if window < 2:
            raise CanaryError(f"window must be >= 2 tokens, got {window}")
        if n_windows < 1:
            raise CanaryError(f"n_windows must be >= 1, got {n_windows}")
        available = stream.size // window
        if available < n_windows:
            raise CanaryError(
                f"token stream of {stream.size} ids holds only {available} windows of {window}; {n_windows} requested"
            )
        rng = np.random.default_rng(seed)
        slots = np.sort(rng.choice(available, size=n_windows, replace=False))
        offsets = slots * window
        windows = np.stack([stream[o : o + window] for o in offsets])
        return cls(windows=windows, offsets=offsets, seed=seed)

    @classmethod
    def load(cls, path: str | Path) -> Canary:
        """Load a ``.npy`` (``[n_windows, window]`` ids) or a ``.npz`` written by :meth:`save`."""
        path = Path(path)
        if not path.exists():
            raise CanaryError(f"canary file not found: {path}")
        try:
            if path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as data:
                    seed = int(data["seed"]) if "seed" in data and int(data["seed"]) >= 0 else None
                    return cls(windows=data["windows"], offsets=data["offsets"], seed=seed)
            return cls(windows=np.load(path, allow_pickle=False))
        except CanaryError:
            raise
        except (ValueError, OSError, KeyError) as exc:
            raise CanaryError(f"cannot read canary file {path}: {exc}") from None

    @classmethod
    def coerce(cls, canary: Any) -> Canary:
        """A :class:`Canary` from a Canary, a 2-D array of token ids, or a saved file's path.

        The one check of the canary argument shared by ``AtlasGate``, the Lightning callback and the
        command line: anything else is a :class:`CanaryError` that names what was given.
        """
        if isinstance(canary, Canary):
            return canary
        if isinstance(canary, (str, Path)):
            return cls.load(canary)
        if isinstance(canary, np.ndarray):
            return cls(windows=canary)
        what = "None" if canary is None else f"a {type(canary).__name__}"
        raise CanaryError(
            "canary must be a Canary, a [n_windows, window] array of token ids, or the path of a saved "
            f"canary (.npz/.npy); got {what}"
        )

    def save(self, path: str | Path) -> Path:
        """Write to ``.npz`` (windows, offsets, seed) or ``.npy`` (windows only), atomically."""
        path = Path(path)
        buf = io.BytesIO()
        if path.suffix == ".npz":
            seed = -1 if self.seed is None else self.seed
            np.savez(buf, windows=self.windows, offsets=self.offsets, seed=np.int64(seed))
        else:
            np.save(buf, self.windows)
        return write_atomic(path, buf.getvalue())

    # --- identity ----------------------------------------------------------------------------
    @property
    def n_windows(self) -> int:
        return int(self.windows.shape[0])

    @property
    def window(self) -> int:
        return int(self.windows.shape[1])

    @property
    def n_tokens(self) -> int:
        return int(self.windows.size)

    @property
    def fingerprint(self) -> str:
        """sha256 of the window layout and the token ids (little-endian int64)."""
        h = hashlib.sha256()
        h.update(f"atlas-canary-v1:{self.n_windows}x{self.window}:".encode())
        h.update(self.windows.astype("<i8").tobytes())
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Canary) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    # --- batching ----------------------------------------------------------------------------
    def batches(self, batch_windows: int) -> list[tuple[int, int]]:
        """Consecutive ``[start, end)`` window ranges of at most ``batch_windows`` windows."""
        return [(s, min(s + batch_windows, self.n_windows)) for s in range(0, self.n_windows, batch_windows)]

    def shard(self, rank: int, world_size: int, batch_windows: int) -> list[tuple[int, int]]:
        """This rank's micro-batches (round-robin). Batches are identical for every world size,
        so per-window results do not depend on how the canary is sharded."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        return self.batches(batch_windows)[rank::world_size]


VOCAB_ATTRS = ("vocab_size", "padded_vocab_size", "n_vocab")
"""Names a model (or its config) uses for the vocabulary size."""
CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "block_size",
                 "n_ctx")
"""Names a model (or its config) uses for the longest sequence it accepts."""


def _declared(holder: Any, names: tuple[str, ...]) -> tuple[int, str] | None:
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, name
    return None


def model_limits(model: Any) -> dict[str, Any]:
    """The vocabulary size and context length a model declares, and where they were found.

    Searched in module order (the model first, then its submodules, so a LightningModule wrapping a
    transformers model finds the inner ``config``): each module's ``config`` and then the module's
    own attributes (``vocab_size``, ``max_position_embeddings``, ``max_sequence_length``,
    ``block_size``, ...). Without a declared vocabulary size, the input embedding table's row count
    bounds the token ids.

    >>> import torch
    >>> model_limits(torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 50)))
    {'vocab_size': 50, 'vocab_where': '0.num_embeddings', 'context': None, 'context_where': None}
    """
    import torch

    out: dict[str, Any] = {"vocab_size": None, "vocab_where": None, "context": None, "context_where": None}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for holder, where in ((getattr(module, "config", None), f"{prefix}config"), (module, name or "model")):
            if holder is None:
                continue
            if out["vocab_size"] is None and (found := _declared(holder, VOCAB_ATTRS)):
                out["vocab_size"], out["vocab_where"] = found[0], f"{where}.{found[1]}"
            if out["context"] is None and (found := _declared(holder, CONTEXT_ATTRS)):
                out["context"], out["context_where"] = found[0], f"{where}.{found[1]}"
        if out["vocab_size"] is not None and out["context"] is not None:
            return out
    if out["vocab_size"] is None:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                out["vocab_size"], out["vocab_where"] = module.num_embeddings, f"{name or 'model'}.num_embeddings"
                break
    return out


def check_canary_fits(model: Any, canary: Canary) -> None:
    """The one check of a canary against a model (ids inside the vocabulary, windows inside the context),
    shared by ``measure``, ``AtlasGate``, the Lightning callback and the command line."""
    limits = model_limits(model)
    top = int(canary.windows.max())
    if limits["vocab_size"] is not None and top >= limits["vocab_size"]:
        raise CanaryError(f"canary token id {top} is out of the model's vocabulary "
                          f"({limits['vocab_where']}={limits['vocab_size']})")
    if limits["context"] is not None and canary.window > limits["context"]:
        raise CanaryError(f"canary window length {canary.window} exceeds the model's context "
                          f"({limits['context_where']}={limits['context']})")
