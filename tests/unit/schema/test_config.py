"""The configuration tree: every key is validated."""

from __future__ import annotations

import pytest

from atlas_tracking import (
    AtlasConfig,
)


def test_bad_config_key():
    with pytest.raises(ValueError, match=r"unknown key 'receipts\.bootstraps'"):
        AtlasConfig.from_dict({"receipts": {"bootstraps": 5}})
