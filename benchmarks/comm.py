"""Collectives per forward per block and bytes per token per block, counted, next to Megatron's
limit 4·(t−1)/t·h·bytes."""

from __future__ import annotations

import torch

from benchmarks.common import CollectiveLog, block_scope, error_text, make_inputs, megatron_limit
from benchmarks.suites import Suite, failed_rows, ok, ratio


def _fmt_kinds(per_block: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in per_block.items()) or "none"


def run(ctx, systems):
    spec, cfg = ctx.spec, ctx.cfg
    rows = failed_rows(ctx, systems)
    x = make_inputs(cfg["vocab_size"], spec["batch"], spec["seq"])
    layers, tokens = cfg["num_hidden_layers"], x.numel()
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    limit = megatron_limit(ctx.tp, cfg["hidden_size"], elem)
    for name, s in ok(systems).items():
        try:
            if s.blocks is None:
                raise RuntimeError("could not find the transformer blocks to attribute collectives")
            fwd, trn = CollectiveLog(), CollectiveLog()
            with torch.no_grad():  # uncounted: one-time setup (tpkit's shm vote) stays out
                s.model(input_ids=x[:, :1], use_cache=False)
            with torch.no_grad(), block_scope(s.blocks, fwd), s.count(fwd):
                s.model(input_ids=x, use_cache=False)
            with block_scope(s.blocks, trn), s.count(trn):
                s.model(input_ids=x, labels=x).loss.backward()
            for p in s.params:
                p.grad = None
            f = fwd.summary(ctx.tp, layers, tokens, ctx.emulated_rs)
            g = trn.summary(ctx.tp, layers, tokens, ctx.emulated_rs)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            rows.append({**ctx.base_row(name), "status": error_text(e)})
            continue
        rows.append(
            {
                **ctx.base_row(name),
                "fwd_per_block": _fmt_kinds(f["per_block"]),
                "fwd_ar_equiv_per_block": f["ar_equiv_per_block"],
                "fwd_bytes_per_token_per_block": f["bytes_per_token_per_block"],
                "megatron_limit": limit,
                "vs_limit": ratio(f["bytes_per_token_per_block"], limit) if limit else None,
                "fwd_outside_blocks": f["outside_blocks"],
                "fwd_outside_bytes_per_token": f["outside_bytes_per_token"],
                "train_fwd_ar_equiv_per_block": g["ar_equiv_per_block"],
                "train_step_collectives": g["total"],
            }
        )
    return rows


def goals(rows):
    out = []
    for r in rows:
        if r["system"] != "tpkit" or r["tp"] != 2 or r["status"] != "ok":
            continue
        out.append(
            dict(
                goal="all-reduce equivalents per block, forward, tpkit tp=2",
                dtype=r["dtype"],
                figure=r["fwd_ar_equiv_per_block"],
                target="== 2",
                met=r["fwd_ar_equiv_per_block"] == 2,
            )
        )
        if r.get("vs_limit") is not None:
            out.append(
                dict(
                    goal="bytes per token per block, tpkit tp=2 / Megatron limit",
                    dtype=r["dtype"],
                    figure=r["vs_limit"],
                    target="<= 1.05",
                    met=r["vs_limit"] <= 1.05,
                )
            )
    return out


SUITE = Suite(
    name="comm",
    title="Collectives per block (counted)",
    run=run,
    goals=goals,
    columns=[
        ("fwd_per_block", "forward, per block", "str"),
        ("fwd_ar_equiv_per_block", "all-reduce equiv./block", "f2"),
        ("fwd_bytes_per_token_per_block", "bytes/token/block", "int"),
        ("megatron_limit", "Megatron limit", "int"),
        ("vs_limit", "÷ limit", "x"),
        ("fwd_outside_blocks", "forward, outside blocks", "int"),
        ("train_step_collectives", "collectives fwd+bwd", "int"),
    ],
    explain=(
        "Counted, not modelled: a TorchDispatchMode records every c10d op (direct "
        "`dist.all_reduce`, as tpkit issues them with grad) and functional collective (DTensor, as "
        "transformers issues them); tpkit's no-grad same-host shared-memory collectives, which "
        "are not c10d ops, are counted through `tpkit.parallel.shm.observe_shm`; the tensor-parallel package's in-process AllReduce/AllGather "
        "are wrapped. Hooks on each decoder layer attribute calls to blocks. Bytes are what each "
        "rank sends with ring algorithms: all-reduce 2(t−1)/t·n, all-gather (t−1)·n_local, gloo's "
        "emulated reduce-scatter as an all-reduce. All-reduce equivalents: all-reduce 1, "
        "all-gather ½, reduce-scatter ½. Megatron's limit is 2 all-reduces of h per token per "
        "block: 4(t−1)/t·h·bytes. `collectives fwd+bwd` is the whole forward+backward of a "
        "training step (embedding and head included)."
    ),
)
