"""One worker of the pool: a fresh interpreter running `main` with the caller's socket
address, started by `Pool`.

It reads its key from stdin, connects to the caller, builds its rank's shards of the model,
then answers requests until told to close. A thread reads stdin to its end: the caller holds
the other end of that pipe, so EOF means the caller is gone and the worker exits at once, even
while it waits in a collective (no orphans after a kernel restart or a ``kill -9``).

Every worker handles the same requests in the same order (SPMD), so a model call reaches the
same collectives on every rank; only rank 0's answer is sent in full.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

from tpkit import config

__all__ = ["build", "main", "optimizer_for"]


def _lifeline() -> None:
    """Exit when the caller's end of stdin closes (the caller died or closed the pool)."""
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


def build(spec: tuple) -> tuple[Any, Any]:
    """This rank's split model from ``spec``, and what ``from_pretrained`` reported, if asked.

    - ``("pretrained", path, kwargs, training)``: ``tpkit.from_pretrained(path, **kwargs)``,
      each rank reading only its slices (a model handed to ``tensor_parallel`` is sent as its
      ``save_pretrained`` checkpoint and built the same way);
    - ``("pickled", file, tp_kwargs, training)``: any other module, saved whole with
      ``torch.save``, memory-mapped here and split with ``tensor_parallel``.
    """
    import torch

    from tpkit.parallelize import parallelize
    from tpkit.pretrained import from_pretrained
    from tpkit.state import TPOptions

    kind, source, kwargs, training = spec
    info = None
    if kind == "pretrained":  # a rank: the face's rank path, never another pool
        model = from_pretrained(source, **kwargs)
        if kwargs.get("output_loading_info"):
            model, info = model
    else:
        model = torch.load(source, weights_only=False, mmap=True)
        model = parallelize(model, None, TPOptions.of(kwargs))
    if training is not None:
        model.train(training)
    from tpkit.parallel.context.apply import context_of

    if (cp := context_of(model)) is not None:
        cp.whole_outputs = True  # the caller holds the model, not a rank: whole logits back
    return model, info


def optimizer_for(model: Any, cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(model.parameters(), ...)`` on a rank: the optimizer of its shards."""
    return cls(model.parameters(), *args, **kwargs)


class Worker:
    """The request loop of one rank (see the module docstring)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self.table: Any = None
        self.device: Any = None

    def reply(self, ok: bool, payload: Any) -> None:
        self.conn.send_bytes(pickle.dumps((ok, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def error(self, exc: BaseException) -> dict:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
        except Exception:  # noqa: BLE001 - any unpicklable exception travels as its text
            payload = None
        return {"rank": self.rank, "time": time.time(), "exc": payload, "traceback": text}

    def serve(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError, KeyboardInterrupt):
                return
            try:
                message = pickle.loads(data)
                if message[0] == "close":
                    return
                out = self.handle(*message)
                self.reply(True, out if self.rank == 0 else None)
            except BaseException as exc:  # noqa: BLE001 - every error goes to the caller
                self.reply(False, self.error(exc))

    def handle(self, op: str, payload: Any, freed: tuple = ()) -> Any:
        import torch

        from tpkit.pool import protocol

        if op == "start":
            model, info = build(payload)
            self.table = protocol.Table(model)
            param = next(iter(model.parameters()), None)
            self.device = param.device if param is not None else torch.device("cpu")
            return {
                "info": info,
                "config": getattr(model, "config", None),
                "generation_config": getattr(model, "generation_config", None),
                "device": self.device,
                "dtype": param.dtype if param is not None else None,
                "training": model.training,
                "type": type(model).__name__,
            }
        table = self.table
        table.free(list(freed))
        if op == "call":
            ref, attr, args, kwargs, grad = payload
            obj = protocol.from_caller(ref, table, self.device)
            fn = getattr(obj, attr) if attr else obj
            args = protocol.from_caller(args, table, self.device)
            kwargs = protocol.from_caller(kwargs, table, self.device)
            with torch.set_grad_enabled(grad):
                out = fn(*args, **kwargs)
            return self.outputs(out, obj)
        if op == "getattr":
            ref, name = payload
            obj = protocol.from_caller(ref, table, self.device)
            return self.outputs(getattr(obj, name), obj, keep_graph=False)
        if op == "backward":
            graph_id, grads = payload
            tensors = table.graphs.pop(graph_id, None)
            if tensors is None:
                raise RuntimeError(
                    "backward through this output a second time (or after it was freed): its "
                    "graph on the workers is gone. Call backward once per forward; for two "
                    "losses of one forward, backward their sum."
                )
            pairs = [(t, g.to(t.device)) for t, g in zip(tensors, grads) if g is not None]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            return None
        if op == "run":
            fn, args, kwargs = payload
            return protocol.plain(fn(table.objects[protocol.MODEL], *args, **kwargs))
        if op == "make":
            fn, args, kwargs = payload
            return table.keep(fn(table.objects[protocol.MODEL], *args, **kwargs))
        raise ValueError(f"tpkit pool: unknown request {op!r}")

    def outputs(self, out: Any, obj: Any, keep_graph: bool = True) -> tuple:
        """``(value, graph id, graph values)``: see `tpkit.pool.protocol.to_caller`."""
        from tpkit.pool import protocol

        table = self.table
        if out is obj or out is table.objects[protocol.MODEL]:  # `return self` (train, eval)
            found = [i for i, o in table.objects.items() if o is out]
            return protocol.RemoteRef(found[0], type(out).__name__), None, []
        grads: list = []
        value = protocol.to_caller(out, table, grads)
        if not grads or not keep_graph:
            return value, None, [g.detach().cpu() for g in grads]
        graph_id = table.new_id()
        table.graphs[graph_id] = grads
        return value, graph_id, [g.detach().cpu() for g in grads]


def main(argv: list[str] | None = None) -> None:
    """Connect, join the process group, serve; exit without interpreter teardown (the
    lifeline thread is blocked reading stdin, and finalizing around it aborts)."""
    address = (argv or sys.argv[1:])[0]
    key = bytes.fromhex(sys.stdin.buffer.readline().decode().strip())
    threading.Thread(target=_lifeline, daemon=True, name="tpkit-pool-lifeline").start()
    rank = config.rank()
    conn = Client(address, family="AF_UNIX", authkey=key)
    conn.send(rank)
    code = 0
    try:
        import torch

        threads = config.omp_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        from tpkit.parallel.mesh import init_distributed

        # the ranks meet in a file of the pool's own folder: a TCP port picked free by the pool
        # could be taken by another process before rank 0 listens on it (EADDRINUSE)
        store = os.path.join(os.path.dirname(address), "store")
        init_distributed(init_method=f"file://{store}")
        Worker(conn, rank).serve()
    except BaseException:  # noqa: BLE001 - printed for the caller, who names this rank
        traceback.print_exc()
        code = 1
    finally:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
