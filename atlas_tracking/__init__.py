"""atlas_tracking: exact MoE atlas receipts for the training stacks MoE teams already use."""

from atlas_tracking.config import AtlasConfig, ConfigError

__all__ = ["AtlasConfig", "ConfigError"]
__version__ = "0.1.0"
