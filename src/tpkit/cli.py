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
    try:
        # first: validation leaves inferred pairs that tp does not divide replicated, with a note
        validate(model, plan, args.tp)
        error = None
    except ValueError as exc:
        error = exc
    print(plan.explain(model, tp_size=args.tp))
    if error is not None:
        print(f"\n{error}", file=sys.stderr)
        return 1
    print(f"\ntp_size={args.tp}: valid")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tpkit.launch import run_script

    return run_script(
        [args.script, *args.args],
        args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        backend=args.backend,
        threads=args.threads,
        module=args.module,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="explain the TP plan of a model (meta device, seconds)")
    p.add_argument("model", help="checkpoint directory or config.json")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size to explain")
    p.add_argument("--plan", help="a YAML plan merged over the automatic one")
    p.add_argument("--model-cls", help="transformers class name, e.g. LlamaForCausalLM")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser(
        "run",
        help="run a script on N ranks: torchrun with tpkit's defaults",
        description="torchrun with tpkit's defaults: OMP_NUM_THREADS = cores / ranks (unless set), "
        "TPKIT_BACKEND from --backend, every output line prefixed [rankN]:. One node runs "
        "--standalone; --nnodes/--rdzv-endpoint use a c10d rendezvous (same command on each node).",
    )
    p.add_argument("--nproc", type=int, help="ranks on this node (default: GPUs, or 2 on CPU)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic range")
    p.add_argument("--rdzv-endpoint", help="host:port of one node, the same on every node")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="sets TPKIT_BACKEND")
    p.add_argument("--threads", type=int, help="OpenMP threads per rank")
    p.add_argument("-m", "--module", action="store_true", help="script is a module name")
    p.add_argument("script", help="the script (or module, with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(fn=cmd_run)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
