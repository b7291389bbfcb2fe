"""Supervised fine-tuning of the demo's MoE with TRL's SFTTrainer, with atlas gates at every evaluation.

``python examples/trl_sft.py`` runs on a laptop CPU in a few minutes:

1. The model: the demo's pretrained Qwen3-MoE (``out/demo/hf/pretrained``, written by ``make demo``)
   when it is there, else the same model (``moe_lightning.build_qwen3_moe``) pretrained here on the
   demo's prose with a plain transformers ``Trainer`` and the callback (``--pretrain-steps``; its gates
   read the pretraining phase, the SFT's the post-training phase, both recognised from the first gate).
2. SFT: chat-formatted prompt/completion pairs made locally from the Python documentation topics
   that lie in the demo's training split (the canary is the demo's, from the held-out end of the
   prose). Two chat tokens are added to the byte vocabulary; the loss is on completions only.
   ``SFTTrainer`` + ``AtlasTrainerCallback``, reporting to W&B (offline) and MLflow (sqlite).
3. The gate table, the gates' wall time against the Trainer's own evaluation time at the same
   steps, and what the trackers hold, read back (W&B from its offline files with wandb's records,
   MLflow from the sqlite store).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import Canary
from atlas_tracking.testing.demo import DEMO_CONFIG, data
from atlas_tracking.testing.demo_data import VOCAB_SIZE
from atlas_tracking.viz.gate_table import gate_table

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|pad|>")
"""Added after the 256 byte ids: ids 256, 257 (end of turn, the eos token), 258 (padding)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EXPERIMENT = "atlas-trl-sft"


def byte_chat_tokenizer():
    """A fast tokenizer whose ids 0..255 are the raw bytes (the demo's vocabulary) plus three chat tokens.

    >>> tok = byte_chat_tokenizer()
    >>> tok("Hi")["input_ids"], len(tok), tok.eos_token_id, tok.pad_token_id
    ([72, 105], 259, 257, 258)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    core = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(VOCAB_SIZE)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    tok.eos_token, tok.pad_token = CHAT_TOKENS[1], CHAT_TOKENS[2]
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _paragraph_groups(text: str, max_chars: int) -> list[str]:
    groups, current = [], ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para or set(para) <= {"*", "="}:
            continue
        if current and len(current) + len(para) + 2 > max_chars:
            groups.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para[:max_chars]
    return [*groups, current] if current else groups


def chat_examples(start: float, end: float, max_chars: int = 400) -> list[dict[str, Any]]:
    """Prompt/completion chat pairs from the documentation topics lying in ``[start, end)`` of the prose
    stream the demo trains on (its fractions: training 0-0.8, validation 0.8-0.9, canary 0.9-1).

    >>> ex = chat_examples(0.0, 0.8)
    >>> ex[0]["prompt"][0]["role"], ex[0]["completion"][0]["role"], len(ex) > 500
    ('user', 'assistant', True)
    """
    from pydoc_data.topics import topics

    keys = sorted(topics)
    total = len("\n\n".join(topics[k] for k in keys))
    out, offset = [], 0
    for key in keys:
        text = topics[key]
        lo, hi = offset, offset + len(text)
        offset = hi + 2
        if lo < start * total or hi > end * total:
            continue
        title = text.split("\n", 1)[0].strip() or key
        for i, answer in enumerate(_paragraph_groups(text, max_chars)):
            out.append({"prompt": [{"role": "user", "content": f"Explain {title}, part {i + 1}."}],
                        "completion": [{"role": "assistant", "content": answer}]})
    return out


def use_trackers(out: Path) -> None:
    """W&B offline and MLflow on sqlite under ``out`` for the Trainer's own integrations (and the gates)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(out.resolve()), WANDB_PROJECT=EXPERIMENT,
                      MLFLOW_EXPERIMENT_NAME=EXPERIMENT)
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT, artifact_location=str((out / "mlartifacts").resolve()))


def finish_trackers() -> None:
    import mlflow
    import wandb

    if wandb.run is not None:
        wandb.finish()
    while mlflow.active_run() is not None:
        mlflow.end_run()


class ByteWindowSet(torch.utils.data.Dataset):
    """Causal-LM windows of the demo's prose for the plain Trainer (``input_ids`` = ``labels``)."""

    def __init__(self, stream: np.ndarray, window: int, length: int, seed: int):
        from atlas_tracking.testing.lightning_lm import ByteWindows

        self.windows = ByteWindows(stream, window, length, seed)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids.clone()}


def pretrain(out: Path, steps: int, prose: tuple[np.ndarray, ...], canary: Canary, config: dict[str, Any]):
    """The demo's model and prose, pretrained with a plain transformers Trainer and the atlas callback: the
    random-weight step-0 baseline makes the gates read the pretraining phase (``policy.phase: auto``)."""
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback
    from transformers import Trainer, TrainingArguments

    from atlas_tracking.testing.lightning_lm import build_qwen3_moe

    train_s, val_s, _ = prose
    every = max(1, steps // 2)
    args = TrainingArguments(
        output_dir=str(out / "pretrain"), max_steps=steps, eval_strategy="steps", eval_steps=every,
        save_strategy="no", per_device_train_batch_size=16, per_device_eval_batch_size=16, learning_rate=3e-3,
        lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0, report_to="none", use_cpu=True,
        logging_steps=every, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    model = build_qwen3_moe(seed=0)
    trainer = Trainer(model, args=args, train_dataset=ByteWindowSet(train_s, 128, steps * 16, 0),
                      eval_dataset=ByteWindowSet(val_s, 128, 16, 1),
                      callbacks=[AtlasTrainerCallback(canary, config)])
    trainer.train()
    model.save_pretrained(out / "pretrained")
    return model


def load_pretrained(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)


def sft(model, out: Path, steps: int, every: int, canary: Canary, config: dict[str, Any], trackers: bool):
    """SFT with TRL's SFTTrainer and the atlas callback; returns the trainer."""
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = byte_chat_tokenizer()
    model.resize_token_embeddings(len(tok))
    args = SFTConfig(
        output_dir=str(out / "sft"), max_steps=steps, eval_strategy="steps", eval_steps=every, save_strategy="no",
        per_device_train_batch_size=8, per_device_eval_batch_size=16, learning_rate=1e-3, lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20), weight_decay=0.0, max_length=256, report_to=["wandb", "mlflow"] if trackers
        else "none", run_name="sft", use_cpu=True, logging_steps=every, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list(chat_examples(0.0, 0.8)),
                         eval_dataset=Dataset.from_list(chat_examples(0.8, 0.9)[:32]),
                         callbacks=[AtlasTrainerCallback(canary, config)])
    trainer.train()
    return trainer


def gate_cost(trainer, records: list[dict[str, Any]], canary: Canary) -> dict[str, Any]:
    """Each gate's wall time (measurement and reading, ``gate_seconds``) beside the Trainer's own evaluation
    time at the same step (``eval_runtime``), the tokens each reads, and all monitoring time (delivery to the
    trackers included)."""
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback

    evals = {int(h["step"]): float(h["eval_runtime"]) for h in trainer.state.log_history if "eval_runtime" in h}
    rows = [{"step": r["step"], "gate_s": r["gate_seconds"], "eval_s": evals.get(r["step"])} for r in records]
    paired = [r for r in rows if r["eval_s"] is not None]
    gate_s, eval_s = sum(r["gate_s"] for r in paired), sum(r["eval_s"] for r in paired)
    ratios = sorted(r["gate_s"] / r["eval_s"] for r in paired if r["eval_s"])
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AtlasTrainerCallback))
    train_s = next((h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h), None)
    return {"per_gate": rows, "gates_s": gate_s, "evaluations_s": eval_s,
            "ratio": gate_s / eval_s if eval_s else None,
            "median_ratio": float(np.median(ratios)) if ratios else None,
            "baseline_s": rows[0]["gate_s"] if rows else None,
            "monitoring_s": callback.gate.seconds_total, "train_runtime_s": train_s,
            "canary_tokens": int(canary.windows.size),
            "eval_tokens": int(sum(len(ids) for ids in trainer.eval_dataset["input_ids"]))}


def read_back(out: Path) -> dict[str, Any]:
    """What the trackers hold: the W&B offline run (wandb's records) and the MLflow run (sqlite store)."""
    from mlflow.tracking import MlflowClient

    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    found: dict[str, Any] = {}
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        run = wait_for_offline_run(run_dir)
        found["wandb"] = {
            "atlas_steps": [row.get("train/global_step") for row in run["history"] if "atlas/c2" in row],
            "eval_loss_steps": [row.get("train/global_step") for row in run["history"] if "eval/loss" in row],
            "alerts": [a["title"] for a in run["alerts"]]}
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    for run in client.search_runs([exp.experiment_id]):
        found["mlflow"] = {
            "atlas/c2 steps": [m.step for m in client.get_metric_history(run.info.run_id, "atlas/c2")],
            "atlas.stage": run.data.tags.get("atlas.stage"),
            "gate artifacts": len(client.list_artifacts(run.info.run_id, "atlas/gates"))}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/trl_sft")
    parser.add_argument("--pretrained", default="out/demo/hf/pretrained",
                        help="a transformers checkpoint of the demo's model (used when it exists)")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="pretraining here when --pretrained is absent")
    parser.add_argument("--steps", type=int, default=200, help="SFT steps")
    parser.add_argument("--eval-every", type=int, default=40, help="SFT evaluation (and gate) interval")
    parser.add_argument("--quick", action="store_true", help="a short run on a 16-window canary (used by the end-to-end test)")
    parser.add_argument("--no-trackers", action="store_true", help="skip W&B and MLflow")
    args = parser.parse_args(argv)
    n_windows = 64
    if args.quick:
        args.pretrain_steps, args.steps, args.eval_every, n_windows = 30, 20, 10, 16
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*")
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit thread count (e.g. on a shared machine) wins
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    prose = data()["prose"]  # the demo's split: training, validation, held-out end (the canary's)
    canary = Canary.from_token_ids(prose[2], window=128, n_windows=n_windows, seed=0)  # the demo's canary
    config = {**DEMO_CONFIG, "receipts": {**DEMO_CONFIG["receipts"], "progress": False}}
    trackers = not args.no_trackers
    pretrained = Path(args.pretrained)
    if (pretrained / "config.json").exists():
        print(f"== model: the demo's pretrained checkpoint {pretrained}", flush=True)
        model = load_pretrained(pretrained)
    else:
        print(f"== model: {pretrained} not found (run `make demo` to use it); pretraining the demo's model on its "
              f"prose for {args.pretrain_steps} steps with a plain transformers Trainer", flush=True)
        model = pretrain(out, args.pretrain_steps, prose, canary, config)
        print(gate_table(_records(out / "pretrain")))
    if trackers:
        use_trackers(out)
    print(f"== SFT: {args.steps} steps of TRL SFTTrainer on chat pairs, a gate every {args.eval_every} steps",
          flush=True)
    try:
        trainer = sft(model, out, args.steps, args.eval_every, canary, config, trackers)
    finally:
        if trackers:
            finish_trackers()
    records = _records(out / "sft")
    cost = gate_cost(trainer, records, canary)
    summary: dict[str, Any] = {"gates": [{k: r.get(k) for k in ("step", "loss", "c2", "dead_experts", "status",
                                                                 "stage")} for r in records],
                               "gate_cost": cost, "wall_time_s": round(time.perf_counter() - t0, 1)}
    print(f"\n-- SFT gates ({out / 'sft' / 'atlas' / 'gates.jsonl'})")
    print(gate_table(records))
    print(f"\n== gate time vs the Trainer's evaluation time (same steps; the gate reads {cost['canary_tokens']} canary "
          f"tokens, the evaluation {cost['eval_tokens']} tokens)")
    for row in cost["per_gate"]:
        eval_s = "-" if row["eval_s"] is None else f"{row['eval_s']:.2f}s"
        print(f"step {row['step']:>4}: gate {row['gate_s']:.2f}s  evaluation {eval_s}")
    if cost["ratio"] is not None:
        print(f"after evaluations: gates {cost['gates_s']:.2f}s vs evaluations {cost['evaluations_s']:.2f}s "
              f"({cost['ratio']:.2f}x in total, median per step {cost['median_ratio']:.2f}x); "
              f"step-0 baseline {cost['baseline_s']:.2f}s")
    if cost["train_runtime_s"]:
        print(f"all monitoring (gates, baseline, delivery to the trackers) {cost['monitoring_s']:.1f}s of "
              f"{cost['train_runtime_s']:.1f}s of SFT ({100 * cost['monitoring_s'] / cost['train_runtime_s']:.1f}%)")
    if trackers:
        summary["trackers"] = read_back(out)
        print("trackers read back:", json.dumps(summary["trackers"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wall time {summary['wall_time_s']}s")
    return 0


def _records(run: Path) -> list[dict[str, Any]]:
    from atlas_tracking import read_history

    return read_history(run / "atlas")


if __name__ == "__main__":
    sys.exit(main())
