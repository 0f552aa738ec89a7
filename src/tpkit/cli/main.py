"""The ``tpkit`` command: ``plan`` (explain a plan on meta, no process group), and the commands
that need ranks, which launch themselves."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from tpkit import config
from tpkit.parallel.mesh import dist_env
from tpkit.trace.gc_quiet import freeze_before_exit

__all__ = ["collapse_layers", "entry", "main"]


class UsageError(Exception):
    """A bad command line: printed as one ``tpkit: error:`` line, exit status 2, no ranks."""


def _checkpoint_dir(path: str, need_weights: bool) -> Path:
    """The local directory ``path`` means: itself (or a config.json's folder), or for a hub id
    its snapshot in the hub cache, fetched if needed and allowed (`tpkit.io.hub`, transformers' own
    resolution: HF_HOME, HF_HUB_OFFLINE, a token)."""
    p = Path(path)
    folder = p.parent if p.is_file() and p.name == "config.json" else p
    if not folder.exists():
        if p.is_absolute() or path.startswith(".") or path.count("/") > 1:
            raise UsageError(f"{path} does not exist (and is no hub id: those read org/name).")
        return _hub_dir(path, need_weights)
    if not (folder / "config.json").is_file():
        raise UsageError(f"{path} has no config.json: not a transformers checkpoint directory.")
    if need_weights:
        from tpkit.io.hub import resolve_checkpoint

        try:
            resolve_checkpoint(folder)
        except FileNotFoundError:
            raise UsageError(
                f"{path} holds no *.safetensors or pytorch_model*.bin weights "
                "(save with save_pretrained)."
            ) from None
    return folder


def _hub_dir(path: str, need_weights: bool) -> Path:
    """A hub id's snapshot directory (its weights fetched too when ``need_weights``)."""
    from tpkit.io.hub import resolve_checkpoint, resolve_folder

    try:
        if need_weights:
            return resolve_checkpoint(path).folder
        return resolve_folder(path)
    except (OSError, ValueError) as exc:  # huggingface_hub's errors are OSError / ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"{path} is not a local directory, and as a hub id it could not be had: {first} "
            "(give a checkpoint directory or config.json, or a hub id in the hub cache / "
            "reachable online)."
        ) from None


def _restarts(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}.")


def collapse_layers(message: str) -> str:
    """One line per repeated layer (``layers.*``, with a count) in a validation error: a 32-layer
    model otherwise prints the same problem 32 times."""
    out: dict[str, int] = {}
    for line in message.splitlines():
        key = re.sub(r"\.\d+\.", ".*.", line)
        out[key] = out.get(key, 0) + 1
    return "\n".join(
        k if n == 1 or not k.startswith("- ") else f"{k} (x{n})" for k, n in out.items()
    )


def _planned(
    path: str,
    model_cls: str | None,
    plan_arg,
    tp: int,
    loading: dict | None = None,
    ep: int = 1,
):
    """(model on meta, derived plan, the validation error or None): no process group.
    ``loading``: the model built as ``from_pretrained`` with those keywords builds it. At
    ``ep`` > 1 the experts modules are placed as `tensor_parallel(ep_size=ep)` places them."""
    from tpkit.io.build import build_on_meta
    from tpkit.plan import derive_plan, validate
    from tpkit.pretrained import meta_model
    from tpkit.sources.expert_placement import check_expert_sizes, place_experts
    from tpkit.trace.analysis import Analysis

    model = build_on_meta(path, model_cls) if loading is None else meta_model(path, **loading)
    analysis = Analysis(model)  # validation reuses the derivation's dry runs
    plan = derive_plan(model, plan_arg or "auto", tp, analysis=analysis)  # undivided: noted
    try:
        if ep > 1:
            plan = place_experts(model, plan)
            check_expert_sizes(model, plan, ep)
        validate(model, plan, tp, analysis=analysis)
    except ValueError as exc:
        return model, plan, exc
    return model, plan, None


def cmd_plan(args: argparse.Namespace) -> int:
    from tpkit.parallel.context.checks import describe
    from tpkit.plan import explain

    _check_tp(args.tp)
    if args.cp < 1 or args.ep < 1:
        raise UsageError(f"--cp and --ep must be >= 1, got --cp {args.cp} --ep {args.ep}.")
    if args.cp > 1 and args.ep > 1:  # as tensor_parallel refuses them
        raise UsageError(
            "--ep with --cp: expert and context parallelism are not built together yet."
        )
    folder = _checkpoint_dir(args.model, need_weights=False)
    loading = {"dtype": args.dtype, "model_cls": args.model_cls} if args.save else None
    model, plan, error = _planned(
        str(folder), args.model_cls, args.plan, args.tp, loading, ep=args.ep
    )
    if error is not None:  # the table would only list shapes that cannot exist
        print(collapse_layers(str(error)), file=sys.stderr)
        return 1
    if args.save:
        _save_plan(folder, model, plan, args)
    context = None
    if args.cp > 1:
        try:
            context = describe(model, args.cp, args.cp_attention, args.tp)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 1
    if args.tp == 1 and args.ep == 1 and context is None:
        print("tp_size=1: one rank holds the whole model; nothing is split, no collectives run.")
        print("Try --tp 2 to see the plan (--ep 2 for an MoE's experts placed whole).")
        return 0
    if args.tp == 1 and args.ep == 1:
        print(f"tp_size=1: the weights are not split.\n\n{context}")
        return 0
    print(explain(plan, model, tp_size=args.tp, ep_size=args.ep))
    if context is not None:
        print(f"\n{context}")
    said = f"tp_size={args.tp}" + (f", ep_size={args.ep}" if args.ep > 1 else "")
    print(f"\n{said}{f', cp_size={args.cp}' if context else ''}: valid")
    return 0


def _save_plan(folder: Path, model, plan, args: argparse.Namespace) -> None:
    """The plan stored beside the checkpoint under the key ``from_pretrained`` computes, so
    that loading it at this tp (and dtype, plan) reads the plan instead of planning."""
    from tpkit.io.plans import saved_plan_path
    from tpkit.plan.cache import plan_key, write_plan

    key = plan_key(model, args.plan or "auto", args.tp)
    path = write_plan(saved_plan_path(folder, key), key, plan)
    dtype = f", dtype={args.dtype!r}" if args.dtype else ""
    print(
        f"saved: {path}\ntpkit.from_pretrained({str(folder)!r}, tp_size={args.tp}{dtype}) reads "
        "this plan instead of planning (while tpkit, transformers and the checkpoint's config "
        "stay as they are; otherwise it plans as usual)."
    )


def cmd_run(args: argparse.Namespace) -> int:
    from tpkit.cli.launch import run_script

    return run_script(
        [args.script, *args.args],
        args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        backend=args.backend,
        threads=args.threads,
        module=args.module,
        max_restarts=args.max_restarts,
    )


#: files one of which a saved tokenizer has (without them transformers may build an empty
#: tokenizer from the config alone, which then fails or garbles the prompt)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)


def _prompt_ids(model_dir: str, prompt: str):
    """(tokenizer or None, token ids) for ``prompt``: the checkpoint's own tokenizer if it saved
    one, else the prompt read as space-separated token ids (tiny test models ship none), each
    checked against the vocabulary."""
    import transformers

    folder = Path(model_dir)
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        return tokenizer, tokenizer(prompt, return_tensors="pt").input_ids
    try:
        ids = [int(t) for t in prompt.split()]
    except ValueError:
        raise UsageError(
            f'{model_dir} has no tokenizer: give the prompt as token ids, e.g. "1 15 27".'
        ) from None
    config = transformers.AutoConfig.from_pretrained(str(folder))
    vocab = getattr(config, "vocab_size", None) or getattr(
        config.get_text_config(), "vocab_size", None
    )
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if not ids or bad:
        raise UsageError(
            f"prompt token ids must be 0 <= id < vocab_size ({vocab}); got {ids or 'none'}."
        )
    return None, torch.tensor([ids])


def _check_generate(args: argparse.Namespace) -> None:
    """Every input of ``tpkit generate`` checked in this process, before any rank starts."""
    _check_tp(args.tp)
    args.model = str(_checkpoint_dir(args.model, need_weights=True))
    _prompt_ids(args.model, args.prompt)
    for name in ("max_new_tokens", "num_beams"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.tp > 1:
        _, _, error = _planned(args.model, None, None, args.tp)
        if error is not None:
            raise UsageError(collapse_layers(str(error)))


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from tpkit.cli.launch import inside_launched_rank, run_script

    if not inside_launched_rank():
        _check_generate(args)
        if args.tp > 1:  # launches itself: the same command on args.tp ranks under torchrun
            return run_script(["tpkit.cli", *args.raw_argv], args.tp, module=True)
    else:  # a hub id: each rank finds the same snapshot in the cache
        args.model = str(_checkpoint_dir(args.model, need_weights=True))

    from tpkit.pretrained import from_pretrained  # a rank: the face's rank path

    model = from_pretrained(args.model, tp_size=args.tp, dtype=args.dtype)
    tokenizer, ids = _prompt_ids(args.model, args.prompt)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            num_beams=args.num_beams,
            temperature=args.temperature if args.sample else None,
            top_k=args.top_k if args.sample else None,
            top_p=args.top_p if args.sample else None,
            pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
        )
    seconds = time.perf_counter() - start
    # a decoder-only model returns prompt + new tokens; an encoder-decoder one, the decoder's
    # start token + new tokens
    new = out[0, 1:] if model.config.is_encoder_decoder else out[0, ids.shape[1] :]
    if dist_env().rank == 0:
        print(tokenizer.decode(new, skip_special_tokens=True) if tokenizer else new.tolist())
        print(
            f"{len(new)} tokens in {seconds:.2f} s: {len(new) / seconds:.1f} tokens/s (tp={args.tp})"
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tpkit.io.checkpoint import export_checkpoint

    if not Path(args.checkpoint).is_dir():
        raise UsageError(f"{args.checkpoint} is not a directory written by tpkit.save_checkpoint.")

    out = export_checkpoint(args.checkpoint, args.out, model_cls=args.model_cls)
    print(f"wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="explain the TP plan of a model (meta device, seconds)")
    p.add_argument("model", help="checkpoint directory, its config.json, or a hub id")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size to explain")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size: an MoE's experts placed whole"
    )
    p.add_argument("--plan", help="a YAML plan merged over the automatic one")
    p.add_argument("--model-cls", help="transformers class name, e.g. LlamaForCausalLM")
    p.add_argument(
        "--save",
        action="store_true",
        help="store the plan beside the checkpoint (tpkit-plans/): from_pretrained reads it",
    )
    p.add_argument("--dtype", help="with --save: the dtype from_pretrained will load in")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size to explain")
    p.add_argument(
        "--cp-attention",
        default="auto",
        choices=["auto", "allgather", "ring", "ulysses"],
        help="how attention sees the whole sequence under --cp",
    )
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser(
        "run",
        help="run a script on N ranks: torchrun with tpkit's defaults",
        description="torchrun with tpkit's defaults: OMP_NUM_THREADS = cores / ranks (unless set), "
        "TPKIT_BACKEND from --backend, every output line prefixed [rankN]:. One node runs "
        "--standalone; --nnodes/--rdzv-endpoint use a c10d rendezvous (same command on each node). "
        "--max-restarts N restarts every rank when one dies, with a fresh rendezvous per attempt.",
    )
    p.add_argument("--nproc", type=int, help="ranks on this node (default: GPUs, or 2 on CPU)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic range")
    p.add_argument("--rdzv-endpoint", help="host:port of one node, the same on every node")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="sets TPKIT_BACKEND")
    p.add_argument("--threads", type=int, help="OpenMP threads per rank")
    p.add_argument(
        "--max-restarts",
        type=_restarts,
        default=0,
        help="restart every rank when one dies or fails, up to N times (the script resumes "
        "itself: tpkit.resume, or Trainer resume_from_checkpoint=True); default 0",
    )
    p.add_argument("-m", "--module", action="store_true", help="script is a module name")
    p.add_argument("script", help="the script (or module, with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint on N ranks (launches itself)",
        description="Loads MODEL_DIR straight into shards on --tp ranks (started for you with "
        "torchrun) and prints rank 0's text and tokens/s.",
    )
    p.add_argument("model", help="checkpoint directory (safetensors or .bin), or a hub id")
    p.add_argument("prompt", help="the prompt (token ids like '1 15 27' if there is no tokenizer)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy/beam")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("export", help="DCP checkpoint -> HF safetensors checkpoint (one process)")
    p.add_argument("checkpoint", help="a directory written by tpkit.save_checkpoint")
    p.add_argument("out", help="output directory for config + model.safetensors")
    p.add_argument("--model-cls", help="transformers class name (default: from the config)")
    p.set_defaults(fn=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``tpkit`` command. From the shell (``argv`` None) an error is one ``tpkit: error:`` line
    (``TPKIT_DEBUG=1`` shows its traceback); called from Python with ``argv`` it raises, except
    for bad command lines, which exit 2 as argparse does."""
    parser = _parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    args.raw_argv = raw
    try:
        return args.fn(args)
    except UsageError as exc:
        parser.exit(2, f"tpkit: error: {exc}\n")
    except (ValueError, OSError) as exc:  # tpkit's own checks say what to do in one message
        if argv is not None or config.debug():
            raise  # called from Python (or debugging): the exception itself
        first = str(exc).strip() or type(exc).__name__
        parser.exit(1, f"tpkit: error: {first}\n(TPKIT_DEBUG=1 shows the traceback)\n")


def entry() -> None:
    """The ``tpkit`` script: `main`, then the process ends without the interpreter's final walk
    of the heap (`freeze_before_exit`, about 1 s after torch and transformers). Only here:
    ``main()`` called in a process that goes on (a test, a notebook) leaves the collector be."""
    try:
        code = main()
    finally:
        freeze_before_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry()
