"""A full disk, soaked: a long plain-loop run whose disk fills and frees at random moments (seeded).

``python benchmarks/disk_full_soak.py --steps 600 --seed 7`` trains a tiny Qwen3-MoE (2 routed layers, 8 experts,
vocabulary 64) with AdamW on random token windows, a gate every ``--gate-every`` steps and ``gate.step`` after every
optimizer step, and keeps ``gate.state_dict()`` as its checkpoint at every gate. The run directory sits on the file
system shim of the tests (:class:`~atlas_tracking.testing.disk_full.Disk`): before each step, with probability
``--p-change``, the disk is filled (no byte free), cut (a random few hundred bytes to a few kB free, so that a
receipts file or a baseline is cut part-way), cut on ``gates.jsonl`` alone (1 to 3000 bytes of lines reach it, so a
line is cut part-way) or freed. Halfway, the process "restarts": a new gate resumes
from the last checkpoint. At the end the disk is freed and ``gate.finish()`` runs. Checked at every gate and at the
end:

- training never stops: every step runs, no exception leaves the gate;
- acknowledged gates are never lost: every gate ``run`` returned as written, and every gate the lineage holds, is in
  the history (across the restart: those of the checkpoint's lineage);
- replay always equals live: ``replay`` of the history gives each gate's recorded decision (status, stage, action),
  and each gate's record in the history is the one ``run`` returned live (or held, and wrote later);
- no torn line is ever left in ``gates.jsonl``, and nothing is logged as a crash.

Writes ``benchmarks/disk_full_soak.json`` and prints it.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import Canary
from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.decisions.replay import replay
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.testing.bench import write_result
from atlas_tracking.testing.disk_full import Disk

HERE = Path(__file__).resolve().parent
CONFIG = {"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}, "gate": {"delivery_wait_s": 1.0}}


class Messages(logging.Handler):
    """The atlas log, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _model(seed: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))


def _decision(record: dict[str, Any]) -> tuple:
    return record["step"], record["status"], record["stage"], record["action"]


def soak(out: Path, steps: int, gate_every: int, seed: int, p_change: float) -> dict[str, Any]:
    rng = random.Random(seed)
    model = _model(seed)
    canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(seed)
    disk = Disk(out)
    messages = Messages()
    logging.getLogger("atlas_tracking").addHandler(messages)
    counts = {"steps_trained": 0, "gates": 0, "fills": 0, "cuts": 0, "line_cuts": 0, "frees": 0, "gates_failed": 0, "restarts": 0,
              "held_lost_at_restart": 0, "replay_mismatches": 0, "replay_checks": 0, "torn_lines_seen": 0}
    acknowledged: set[tuple[int, str]] = set()  # every gate the run committed (its line written), by (step, branch)
    returned: dict[tuple[int, str], dict[str, Any]] = {}  # the records run returned as written
    failed: list[tuple[int, str]] = []  # the gates run returned as failed
    gate = AtlasGate(model, canary, CONFIG, out_dir=out)
    checkpoint: dict[str, Any] | None = None
    loss: float | None = None
    t0 = time.perf_counter()

    def check() -> None:
        """No torn line, and replay of the history equals the decisions each gate recorded live."""
        acknowledged.update((int(s), b) for s, b in gate.lineage)
        if not (out / "gates.jsonl").is_file():
            return
        counts["torn_lines_seen"] += not (out / "gates.jsonl").read_bytes().endswith(b"\n")
        history = read_history(out)
        replayed = replay(history, AtlasConfig.coerce(CONFIG))
        counts["replay_checks"] += 1
        counts["replay_mismatches"] += sum(_decision(a) != _decision(b) for a, b in zip(replayed, history))

    with disk.mounted():
        for step in range(steps + 1):
            if rng.random() < p_change:
                kind = rng.choice(("fill", "cut", "cut_line", "free"))
                if kind == "fill":
                    disk.fill()
                elif kind == "cut":
                    disk.room(rng.randint(200, 6000))
                elif kind == "cut_line":
                    disk.cut("gates.jsonl", after=rng.randint(1, 3000))
                else:
                    disk.room()
                counts[{"fill": "fills", "cut": "cuts", "cut_line": "line_cuts", "free": "frees"}[kind]] += 1
            if step == steps // 2 and checkpoint is not None:  # a restart from the last checkpoint
                counts["held_lost_at_restart"] = gate.held.waiting()  # the process dies with what it held
                gate = AtlasGate(model, canary, CONFIG, out_dir=out)
                gate.resume(step, checkpoint)
                counts["restarts"] += 1
            if step % gate_every == 0:
                record = gate.run(step, loss=loss)
                counts["gates"] += 1
                if record["status"] == "FAILED":
                    counts["gates_failed"] += 1
                    failed.append((step, record["branch"]))
                else:
                    returned[(step, record["branch"])] = record
                checkpoint = gate.state_dict()
                check()
            ids = torch.randint(0, 64, (8, 33), generator=data)
            objective = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
            optimizer.zero_grad()
            objective.backward()
            optimizer.step()
            loss = float(objective.detach())
            gate.step(step)
            acknowledged.update((int(s), b) for s, b in gate.lineage)
            counts["steps_trained"] += 1
        disk.room()
        gate.finish()
    check()
    logging.getLogger("atlas_tracking").removeHandler(messages)
    history = read_history(out)
    kept = {(r["step"], r["branch"]): r for r in [*history, *read_lines(out / "gates.abandoned.jsonl")]}
    errors = [(e["step"], e["branch"]) for name in ("errors.jsonl", "errors.abandoned.jsonl") for e in read_lines(out / name)]
    resumes = [(r, history[i - 1]) for i, r in enumerate(history) if r.get("resume") and i > 0]
    counts.update(
        seconds=round(time.perf_counter() - t0, 1), history_gates=len(history),
        gates_acknowledged=len(acknowledged), acknowledged_lost=len(acknowledged - set(kept)),
        records_returned_live_not_as_recorded=sum(kept.get(k) != r for k, r in returned.items()),
        resume_stage_disagreements=sum(r.get("stage_before_resume") != last["stage"] for r, last in resumes),
        errors_lines=len(errors), failures_not_recorded=sorted(set(failed) - set(errors)),
        failures_recorded_twice=len(errors) - len(set(errors)), errors_without_a_failed_gate=sorted(set(errors) - set(failed)),
        writes_refused=disk.refused, gates_written_late=sum("repaired the record" in m for m in messages.lines),
        crash_messages=sum("crash" in m for m in messages.lines))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--gate-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--p-change", type=float, default=0.08, help="chance per step that the disk fills, is "
                        "cut to a few kB or is freed")
    parser.add_argument("--out", default=str(HERE / "disk_full_soak.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counts = soak(Path(tmp) / "atlas", args.steps, args.gate_every, args.seed, args.p_change)
    write_result({"steps": args.steps, "gate_every": args.gate_every, "seed": args.seed, "p_change": args.p_change,
                  **counts}, args.out)


if __name__ == "__main__":
    main()
