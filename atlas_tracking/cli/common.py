"""What the commands share: the one-line error, the model options, loading a checkpoint and a config."""

from __future__ import annotations

import argparse

from atlas_tracking.schema.config import AtlasConfig

EXIT_ERROR = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def load_config(path: str | None) -> AtlasConfig:
    """The configuration a ``--config`` option names, or the defaults."""
    return AtlasConfig.from_yaml(path) if path else AtlasConfig()


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the commands that load transformers checkpoints."""
    p.add_argument("--config", help="atlas YAML config")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
