"""Artifacts and records: what a gate writes to disk and how it is read back.

``io`` (atomic writes, JSON-ready values), ``derivation`` (receipts from per-window arrays, shared by
``measure`` and ``verify``), ``gate_report`` (the receipts artifact and its verifier), ``baseline`` (the
reference gate with its anchor tensors), ``record`` (the gate record and its tracker metrics), ``history``
(crash-safe JSON lines and the one reader of a run's history) and ``run_dir`` (a run directory's files,
repair and rewind). Imports only ``receipts`` and ``schema``.
"""
