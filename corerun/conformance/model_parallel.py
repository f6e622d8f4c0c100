"""The model suite's tensor-parallel check: a family on two gloo ranks (two CPU processes) against itself on one.

:func:`tensor_parallel_logits` writes the checkpoint to a folder, starts two spawned processes that
join a gloo group on 127.0.0.1, build the family with ``tp=`` their rank's
:class:`~corerun.distributed.group.TensorParallelGroup`, load the checkpoint (each weight loader cuts
its rank's slice) and run the same steps through the suite's ``Driver``; rank 0's logits come back.
"""

from __future__ import annotations

import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, cls: Any, config: Any, folder: str, steps: list[list[tuple[int, list[int]]]], port: int) -> None:
    """One rank: build, load, run ``steps`` (each a list of ``(cached, new_ids)`` in one block table per
    request), save rank 0's logits (or any rank's error) in ``folder``."""
    import torch
    import torch.distributed as dist

    from corerun.conformance.model_suite import Driver
    from corerun.distributed.group import TensorParallelGroup
    from corerun.models.loader import iterate_weights, load_weights

    out = Path(folder)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
        tp = TensorParallelGroup(rank, WORLD_SIZE, torch.device("cpu"))
        torch.set_default_dtype(torch.float64)
        model = cls(config, tp=tp)
        load_weights(model, iterate_weights([out / "model.safetensors"]), source=f"rank {rank}'s checkpoint")
        driver = Driver(model.eval())
        tables: dict[int, list[int]] = {}
        rows = []
        for step in steps:
            for i, (cached, ids) in enumerate(step):
                if i not in tables:
                    tables[i] = driver.blocks(8)
            rows += driver.run(step, tables=[tables[i] for i in range(len(step))])
        if rank == 0:
            torch.save(torch.cat(rows), out / "logits.pt")
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tensor_parallel_logits(cls: Any, config: Any, state: dict[str, Any], steps: list[list[tuple[int, list[int]]]]) -> Any:
    """Rank 0's float64 logits of ``steps`` (every row, concatenated) with ``cls`` split over two ranks;
    raises ``RuntimeError`` with a rank's traceback when one fails or the pair does not finish in time."""
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="corerun-tp-check-") as folder:
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(folder) / "model.safetensors"))
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, cls, config, folder, steps, port), daemon=True) for r in range(WORLD_SIZE)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        alive = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = sorted(Path(folder).glob("error-*.txt"))
        if errors:
            raise RuntimeError(f"{errors[0].stem.replace('-', ' ')} failed:\n{errors[0].read_text()[-2000:]}")
        if alive:
            raise RuntimeError(f"ranks {alive} did not finish within {TIMEOUT_S:.0f} s")
        if not (Path(folder) / "logits.pt").is_file():
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"rank 0 wrote no logits (exit codes {codes})")
        return torch.load(Path(folder) / "logits.pt")
