"""Command line: `python -m bst_fast train ...` and `python -m bst_fast star ...` (the star-graph reproduction)."""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _apply_sets(cfg, sets):
    """--set a.b=value overrides, values parsed as YAML (so 6, 3e-4, true, null, [1, 2] work)."""
    import yaml

    from .train import TrainConfig

    d = cfg.to_dict()
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"config field {key!r} is unknown")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"config field {key!r} is unknown")
        node[leaf] = yaml.safe_load(value)
    return TrainConfig.from_dict(d)


def _load(args):
    from .train import TrainConfig

    cfg = TrainConfig.load(args.config) if args.config else TrainConfig()
    return _apply_sets(cfg, args.set or [])


def cmd_train(args):
    from .train import train

    cfg = _load(args)
    result = train(cfg, resume=args.resume)
    print(json.dumps({k: round(v, 6) for k, v in result.items()}, indent=1))


def cmd_star(args):
    """Trains the BST and the forward-only baseline on one config and prints their path accuracy."""
    from .train import train

    base = _load(args)
    rows = []
    for method in args.methods:
        cfg = copy.deepcopy(base)
        cfg.method = method
        cfg.out_dir = str(Path(base.out_dir) / method)
        print(f"== {method}: G({cfg.star_degree},{cfg.star_path_len}), N={cfg.star_nodes}, "
              f"{cfg.model.n_layer} layers x {cfg.model.d_model}, {cfg.steps} steps of {cfg.batch_size}", flush=True)
        result = train(cfg, resume=args.resume)
        rows.append((method, result))
    print("\n| method | path accuracy | final loss | steps/s |")
    print("| --- | --- | --- | --- |")
    for method, r in rows:
        print(f"| {method} | {r.get('path_accuracy', float('nan')):.3f} | {r.get('loss', float('nan')):.4f} | "
              f"{r.get('steps_per_s', float('nan')):.2f} |")
    d = base.star_degree
    print(f"\n(a forward-only model that learned only the 'flawed cheat' scores about 1/d = {1 / d:.3f})")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bst_fast", description="Belief State Transformer training")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train one model"), ("star", "star-graph reproduction: BST vs forward-only")):
        p = sub.add_parser(name, help=helptext)
        default = str(CONFIGS / "star_cpu.yaml") if name == "star" else None
        p.add_argument("--config", default=default, help="YAML or JSON TrainConfig" +
                       (f" (default {default})" if default else ""))
        p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field, e.g. model.n_layer=6")
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
        if name == "star":
            p.add_argument("--methods", nargs="+", default=["bst", "forward"], choices=["bst", "forward"])
    args = ap.parse_args(argv)
    try:
        {"train": cmd_train, "star": cmd_star}[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
