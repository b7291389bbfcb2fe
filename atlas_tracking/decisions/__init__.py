"""Runtime decisions on gate records: no model, no torch.

``phases`` (pretraining or post-training), ``policy`` (status, stage, licensed claims, first intervention),
``alerts`` (stage alerts and threshold rules), ``protection`` (``protected_layers: auto``), ``judge`` (is a
candidate run a real fix?) and ``replay`` (the policy over a recorded history).
"""
