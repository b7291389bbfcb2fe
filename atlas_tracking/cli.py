"""The ``atlas-tracking`` command line: measure, verify, compare, replay, report, judge, protect.

Errors are one line on stderr with exit code 2; ``verify`` exits 1 on a disagreement; ``judge`` exits 0 for
a real fix, 1 for not yet, 2 for not comparable.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from atlas_tracking.canary import Canary
from atlas_tracking.config import AtlasConfig
from atlas_tracking.gate_report import read_artifact, verify
from atlas_tracking.tables import layer_table, summary_line

EXIT_ERROR = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def load_hf_model(model_dir: str, dtype: str = "auto", device: str = "cpu"):
    """Load a transformers causal LM (or a composite model, measured through its text model) from a local
    checkpoint directory (safetensors weights)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise CLIError(f"loading --model needs transformers (pip install 'atlas-tracking[hf]'): {exc}") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise CLIError(f"{model_dir} is not a transformers checkpoint directory (no config.json)")
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    from atlas_tracking.checkpoints import from_pretrained

    return from_pretrained(path, torch_dtype).to(device).eval()


def _config(path: str | None) -> AtlasConfig:
    return AtlasConfig.from_yaml(path) if path else AtlasConfig()


def cmd_measure(args: argparse.Namespace) -> int:
    from atlas_tracking.measure import measure

    cfg = _config(args.config)
    cfg.receipts.progress = cfg.receipts.progress and not args.quiet
    canary = Canary.load(args.canary)
    model = load_hf_model(args.model, args.dtype, args.device)
    baseline = None
    if args.baseline:
        from atlas_tracking.baseline import Baseline

        baseline = Baseline.load(args.baseline)
    t0 = time.perf_counter()
    keep = bool(args.save_baseline) or None
    report = measure(model, canary, baseline=baseline, config=cfg, step=args.step, keep_anchors=keep)
    elapsed = time.perf_counter() - t0
    report.save(args.out)
    if args.save_baseline:
        from atlas_tracking.baseline import Baseline

        Baseline.from_report(report).save(args.save_baseline)
    print(layer_table(report.layers))
    damage = {k: v for k, v in (report.drift or {}).items() if k in ("kl_base", "canary_nll_delta")}
    print(summary_line({**report.summary, **damage}))
    if report.drift is not None and report.drift.get("kl_base_absent"):
        print(f"kl_base absent: {report.drift['kl_base_absent']}")
    print(f"wrote {args.out} ({len(report.layers)} routed layers, {canary.n_tokens} canary tokens, {elapsed:.2f}s)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    data = read_artifact(args.receipts)
    problems = verify(data)
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        print(f"{args.receipts}: {len(problems)} disagreement(s)", file=sys.stderr)
        return 1
    n = len(data["layers"])
    print(f"{args.receipts}: OK, every receipt, CI, pass/fail and summary recomputed from per-window arrays ({n} layers)")
    return 0


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the commands that load transformers checkpoints."""
    p.add_argument("--config", help="atlas YAML config")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_measure(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measure", help="measure atlas receipts of a transformers checkpoint on a canary")
    p.add_argument("--model", required=True, help="transformers checkpoint directory (safetensors)")
    p.add_argument("--canary", required=True, help=".npy [n_windows, window] token ids, or .npz from Canary.save")
    p.add_argument("--baseline", help="baseline directory (adds drift and paired deltas)")
    p.add_argument("--save-baseline", help="save this gate as a baseline directory")
    p.add_argument("--out", required=True, help="receipts JSON to write")
    p.add_argument("--step", type=int, default=None)
    add_model_options(p)
    p.set_defaults(func=cmd_measure)


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="recompute every pass/fail and summary of a receipts JSON")
    p.add_argument("receipts")
    p.set_defaults(func=cmd_verify)


def _optional_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Sub-commands living in their own modules (each exposes ``register(subparsers)``)."""
    from atlas_tracking import compare, replay, report
    from atlas_tracking.integrations import wandb_workspace
    from atlas_tracking.judge import register as register_judge
    from atlas_tracking.protection import register as register_protect

    return [compare.register, replay.register, report.register, register_judge, register_protect,
            wandb_workspace.register]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas-tracking", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_measure(sub)
    _add_verify(sub)
    for register in _optional_commands():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, OSError, KeyError, FloatingPointError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"atlas-tracking {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

