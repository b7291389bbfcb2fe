"""Declarations: what the configuration, the gate record and the artifacts hold (the lowest layer, with receipts).

``config`` is the validated configuration tree; ``record`` the gate record's fields, its status, stage and
phase enums and the tracker metrics derived from them; ``artifacts`` the kinds, versions and section names of
the files a gate writes. Every field list elsewhere is derived from these modules.
"""
