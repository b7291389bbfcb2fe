"""Where atlas_tracking meets other frameworks (Lightning, DeepSpeed, Megatron-Core, W&B, MLflow).

Each module imports its framework lazily, so the engine never needs them installed.
"""
