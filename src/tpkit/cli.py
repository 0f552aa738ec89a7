"""The ``tpkit`` command: ``plan`` (explain a plan on meta, no process group), and the commands
that need ranks, which launch themselves."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn


def build_on_meta(path: str, model_cls: str | None = None) -> nn.Module:
    """Instantiate a model from a checkpoint dir or config.json on the meta device (no weights)."""
    import transformers

    p = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(p.parent if p.is_file() else p))
    names = [model_cls] if model_cls else list(getattr(config, "architectures", None) or [])
    classes = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
    classes += [
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForSeq2SeqLM,
        transformers.AutoModel,
    ]
    errors = []
    with torch.device("meta"):
        for cls in classes:
            try:
                if hasattr(cls, "from_config"):
                    return cls.from_config(config)
                return cls(config)
            except (ValueError, KeyError, TypeError) as exc:
                errors.append(f"{getattr(cls, '__name__', cls)}: {exc}")
    raise ValueError(f"Could not build a model for {path}:\n" + "\n".join(errors))


def cmd_plan(args: argparse.Namespace) -> int:
    from tpkit.plan import derive_plan, validate

    model = build_on_meta(args.model, args.model_cls)
    plan = derive_plan(model, args.plan or "auto")
    print(plan.explain(model, tp_size=args.tp))
    try:
        validate(model, plan, args.tp)
    except ValueError as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 1
    print(f"\ntp_size={args.tp}: valid")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="explain the TP plan of a model (meta device, seconds)")
    p.add_argument("model", help="checkpoint directory or config.json")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size to explain")
    p.add_argument("--plan", help="a YAML plan merged over the automatic one")
    p.add_argument("--model-cls", help="transformers class name, e.g. LlamaForCausalLM")
    p.set_defaults(fn=cmd_plan)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
