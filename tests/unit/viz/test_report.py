"""The HTML report and its figures."""

from __future__ import annotations

from atlas_tracking.receipts.lifecycle import protected_ordinals
from atlas_tracking.viz.figures import fig_layer_c2, pyplot


def test_report_groups_layers_by_the_records_protected_flag():
    """The report's per-layer figure calls 'mid' (protected) exactly the layers the records mark protected."""
    n = 8
    protected = set(protected_ordinals(n, "mid"))
    layers = [{"name": f"model.layers.{i}.mlp", "ordinal": i, "protected": i in protected, "c2": 0.1} for i in range(n)]
    fig = fig_layer_c2(layers, "t")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    pyplot().close(fig)
    shown = {label.split(": ")[1] for label in labels if label.split(": ")[0] in ("mid", "protected")}
    assert shown == {f"layer {i}" for i in protected}  # the model's own layer numbers
