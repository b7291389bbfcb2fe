"""The measurement engine: a gate's forward pass with capture hooks, on the model's own device.

``canary`` (the fixed probe windows), ``anchors`` (the drift subset), ``capture`` (per-layer hooks that reduce
per-token receipts to per-window sums inside the forward), ``fields`` (expert fields, exchanged across an
expert-parallel group), ``sharding`` (ZeRO-3 / FSDP2 parameters during a gate), ``selfcheck`` (the adapter
checked against the model's own forward), ``measure`` (one gate: the receipts of a model on a canary),
``param_reference`` (parameter drift) and ``lineage`` (drift between two checkpoints).
"""
