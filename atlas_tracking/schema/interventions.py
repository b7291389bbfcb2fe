"""The first interventions of Table 14 as actions an operator can take: what to change, and the lines that change
it in Lightning, the transformers Trainer (and TRL), DeepSpeed and Megatron-Core (docs/policy.md#first-interventions).

A gate's record holds the action's text (``intervention``); :func:`recipe_for` finds the recipe that text came
from, so the report and ``atlas-tracking gates`` can print its configuration lines.

Example:
    >>> recipe = recipe_for(RECIPES["overlap_and_occupancy"].action)
    >>> recipe.pattern, sorted(recipe.lines)
    ('overlap_and_occupancy', ['DeepSpeed', 'Lightning', 'Megatron-Core', 'transformers Trainer'])
    >>> recipe_for("a text no recipe wrote") is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

FRAMEWORKS = ("Lightning", "transformers Trainer", "DeepSpeed", "Megatron-Core")
"""The training stacks each recipe gives lines for, in the order they are shown."""


@dataclass(frozen=True)
class Recipe:
    """One Table 14 row: the observed pattern, the action in words and, per framework, the lines that carry it out."""

    pattern: str
    when: str
    action: str
    lines: dict[str, str] = field(default_factory=dict)


LOAD_BALANCE = {
    "Lightning": "model.config.output_router_logits = True          # the loss then carries the aux loss\n"
                 "model.config.router_aux_loss_coef *= 5           # 0.001 -> 0.005 for Qwen3-MoE",
    "transformers Trainer": "model.config.output_router_logits = True\n"
                            "model.config.router_aux_loss_coef *= 5           # before Trainer(model=model, ...)",
    "DeepSpeed": "output, l_aux, _ = moe_layer(hidden)               # deepspeed.moe.layer.MoE\n"
                 "loss = lm_loss + 5 * aux_coef * l_aux",
    "Megatron-Core": "TransformerConfig(..., moe_router_load_balancing_type=\"aux_loss\",\n"
                     "                  moe_aux_loss_coeff=5 * old_coeff)  # --moe-aux-loss-coeff",
}
"""A five times larger load-balancing (router prior) loss, as each stack sets it."""

PROTECT = {
    "Lightning": "for i in WORST_LAYERS:                            # the report's worst layers\n"
                 "    model.model.layers[i].requires_grad_(False)   # in configure_model(), before fit",
    "transformers Trainer": "for i in WORST_LAYERS:\n"
                            "    model.model.layers[i].requires_grad_(False)   # before Trainer(model=model, ...)",
    "DeepSpeed": "frozen = {f\"layers.{i}.\" for i in WORST_LAYERS}\n"
                 "params = [p for n, p in model.named_parameters() if not any(f in n for f in frozen)]\n"
                 "engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)",
    "Megatron-Core": "for layer in model.decoder.layers:                # this pipeline stage's layers\n"
                     "    if layer.layer_number - 1 in WORST_LAYERS:     # layer_number counts from 1\n"
                     "        layer.requires_grad_(False)               # before get_megatron_optimizer",
}
"""The worst layers frozen (resumed from the last clean gate's checkpoint), as each stack does it."""

SPLIT = ("is_router = lambda n: n.endswith(\"mlp.gate.weight\")\n"
         "router = [p for n, p in model.named_parameters() if is_router(n)]\n"
         "rest = [p for n, p in model.named_parameters() if not is_router(n)]\n")
"""The router's parameters and the rest (a transformers MoE names its router ``mlp.gate``)."""

ROUTER_FP32 = {
    "Lightning": SPLIT + "AdamW([{\"params\": router, \"lr\": lr / 10}, {\"params\": rest, \"lr\": lr}])"
                 "  # configure_optimizers",
    "transformers Trainer": SPLIT + "Trainer(..., optimizers=(AdamW([{\"params\": router, \"lr\": lr / 10},\n"
                            "                                {\"params\": rest, \"lr\": lr}]), None))",
    "DeepSpeed": SPLIT + "deepspeed.initialize(model=model, config=ds_config, model_parameters=[\n"
                 "    {\"params\": router, \"lr\": lr / 10}, {\"params\": rest}])",
    "Megatron-Core": "TransformerConfig(..., moe_router_dtype=\"fp32\")     # --moe-router-dtype fp32",
}
"""The router's learning rate a tenth of the rest (its scores in fp32 under Megatron-Core)."""

KEEP = {name: "# no change to training; read the next gate:\natlas-tracking gates RUN_DIR" for name in FRAMEWORKS}
"""No change: the next gate is read first."""

RECIPES = {
    "overlap_and_occupancy": Recipe(
        "overlap_and_occupancy", "C2 worsening and occupancy degrading",
        "Raise the load-balancing (router prior) loss weight five-fold and resume from the last gate before the "
        "alert; compare the two runs at matched loss with atlas-tracking judge. Do not keep training passively.",
        LOAD_BALANCE),
    "atlas_drift": Recipe(
        "atlas_drift", "C2 worsening, occupancy healthy",
        "Freeze the worst protected layers the gate names (or give them a tenth of the learning rate) and resume "
        "from the last clean gate's checkpoint, before changing the experts.", PROTECT),
    "repair": Recipe(
        "repair", "a rebound with occupancy repair",
        "Keep training unchanged, and declare recovery only after two more jointly recovering gates.", KEEP),
    "occupancy": Recipe(
        "occupancy", "occupancy degrading, C2 not worsening",
        "Counter the narrowing of expert usage: raise the load-balancing (router prior) loss weight five-fold and "
        "check the data mix against the baseline's, before claiming handoff or preservation.", LOAD_BALANCE),
    "boundary": Recipe(
        "boundary", "C2 stable while the State1 margin shrank since the previous gate",
        "Give the router a tenth of the learning rate (its scores in fp32) and take the next gate before any "
        "broader intervention.", ROUTER_FP32),
    "resume": Recipe(
        "resume", "a resume baseline",
        "Do nothing except collect the first valid post-baseline gate.", KEEP),
    "collapse": Recipe(
        "collapse", "pretraining occupancy collapse",
        "Raise the load-balancing loss weight, lower the router's learning rate and re-initialise the router; an "
        "atlas cannot form around dead experts.", LOAD_BALANCE),
}
"""Table 14, by the pattern observed, in the order the policy tries them (docs/policy.md#first-interventions)."""


def recipe_for(text: str | None) -> Recipe | None:
    """The recipe whose action a record's ``intervention`` states (None for no intervention or another text)."""
    return next((r for r in RECIPES.values() if r.action == text), None)


def recipes_table() -> str:
    """Table 14 as Markdown for the docs: pattern, when, the action, and per framework the lines that carry it out.

    >>> print(recipes_table().splitlines()[0])
    | pattern | when | first intervention |
    """
    rows = ["| pattern | when | first intervention |", "|---|---|---|"]
    rows += [f"| {r.pattern.replace('_', ' ')} | {r.when} | {r.action} |" for r in RECIPES.values()]
    out = ["\n".join(rows), "", "The lines that carry each action out:", ""]
    seen: set[int] = set()
    for r in RECIPES.values():
        if id(r.lines) in seen:
            continue
        seen.add(id(r.lines))
        names = ", ".join(x.pattern.replace("_", " ") for x in RECIPES.values() if x.lines is r.lines)
        out.append(f"**{names}**\n")
        for name in FRAMEWORKS:
            out.append(f"*{name}*:\n\n```\n{r.lines[name]}\n```\n")
    return "\n".join(out)
