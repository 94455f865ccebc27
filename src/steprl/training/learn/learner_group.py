"""The learner as a group of processes (`runtime.learner_ranks: N` > 1): N Ray actors, each an
FSDP2 rank (`rank_learner.py`), placed with a placement group (`runtime.learner_placement`:
PACK by default, SPREAD to put them on different nodes), joined in one gloo process group.

The trainer stays the single controller: it calls this object through the `Learner` protocol,
and this object calls every rank with the same arguments and waits, each wait bounded by
`runtime.learner_timeout_s`. A rank that dies or does not answer stops the run with one line
naming the rank and what it was doing (`LearnerGroupError`); the group's actors are killed, so
no process is left behind.

Weights leave the group gathered on rank 0 (the engines' updates, the final model); the
checkpoint holds the full weights and optimizer state, written as one process writes them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import nn

from steprl.engines.transports.collective import GroupAddress
from steprl.engines.weights import BUCKET_BYTES, Bucket, WeightUpdate, untied
from steprl.errors import UserError
from steprl.hosting.ray_backend import ensure_ray
from steprl.rollout.views import Sample
from steprl.rollout.weight_group import Waiter, ray_waiter
from steprl.training.learn import checkpoint as ckpt
from steprl.training.learn import optimizer_state, sharded_state, snapshot_layout
from steprl.training.learn.batching import minibatches
from steprl.training.learn.learner_protocol import Computed, LearnerLevers
from steprl.training.learn.lora import ADAPTERS_OFF, AdaptersDisabled, adapter_update, is_peft
from steprl.training.learn.rank_learner import ModelParts, start_rank


class LearnerGroupError(UserError):
    """A rank died, hung past its deadline, or could not start: one line, the run stops."""


class _Rank:
    """One rank, inside its Ray actor process."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # the ranks share the machine's cores: one each
        self.learner: Any = None
        self.rows: tuple[int, list[Sample]] | None = None  # the set of rows last sent, its key

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the others: this node's address and a free port."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def start(
        self,
        model: ModelParts,
        settings: dict[str, Any],
        rank: int,
        world: int,
        addr: str,
        port: int,
        timeout_s: float,
    ) -> None:
        self.learner = start_rank(
            model, settings, rank=rank, world=world, init_method=f"tcp://{addr}:{port}", timeout_s=timeout_s
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.learner, method)(*args, **kwargs)

    def call_on_rows(
        self, method: str, key: int, rows: list[Sample] | None, *args: Any, **kwargs: Any
    ) -> Any:
        """`method(rows, ...)` on the set of rows `key`: sent once (`rows`), then held (None), so
        a step's passes over the same set reach the learner as the same object and each row is
        collated once (`Collator`), not once per call."""
        if rows is not None:
            self.rows = (key, rows)
        if self.rows is None or self.rows[0] != key:
            raise RuntimeError(f"rank holds no row set {key}: the controller sends each set before using it")
        return getattr(self.learner, method)(self.rows[1], *args, **kwargs)


_RankActor = ray.remote(_Rank)


class RanksSender:
    """The ranks as rank 0 of a weights group (`rollout/weight_group.py: Sender`): rank 0 joins
    and broadcasts, every rank gathers its shards into rank 0's bucket as it goes; or, for an
    engine in this process, the full weights gathered here (the last version's kept)."""

    def __init__(self, group: LearnerGroup) -> None:
        self.group = group
        self._gathered: tuple[int, dict[str, torch.Tensor]] | None = None

    def join(self, address: GroupAddress) -> Waiter:
        return ray_waiter([self.group.actors[0].call.remote("join_weights_group", address)])

    def send(self, update: WeightUpdate) -> Waiter:
        args = (update.version, list(update.names), update.bucket_bytes)
        return ray_waiter([a.call.remote("broadcast_weights", *args) for a in self.group.actors])

    def gather(self, version: int, bucket_bytes: int) -> Iterator[Bucket]:
        if self._gathered is None or self._gathered[0] != version:
            full = self.group._full()  # the ranks' shards join into separate tensors: the tie is the model's
            self._gathered = (version, {k: full[k] for k in self.group.untied})
        return iter(WeightUpdate.of_tensors(self._gathered[1], version, bucket_bytes).produce())

    def forget(self) -> None:
        """The sync is over: the weights gathered for it (if any engine here asked) go."""
        self._gathered = None


class LearnerGroup:
    """The `Learner` protocol over N FSDP2 ranks. `model` (CPU) is the policy as it starts: each
    rank gets a copy and shards it; this process keeps it to write the final model."""

    def __init__(
        self,
        model: nn.Module,
        settings: dict[str, Any],
        *,
        ranks: int,
        placement: str = "pack",
        timeout_s: float = 300.0,
        gpus_per_rank: float = 0.0,
        mixed_precision: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        # prefix-tree rows run a varying number of forward segments per micro-batch: the ranks'
        # all-gathers would fall out of step, so the ranks train on plain rows
        settings = {**settings, "pack": False}
        if gpus_per_rank > 0:  # each rank its GPU (Ray sets CUDA_VISIBLE_DEVICES), NCCL between them
            settings |= {"device": "cuda", "mixed_precision": mixed_precision}
        settings["cpu_offload"] = cpu_offload
        if isinstance(settings.get("ref_model"), AdaptersDisabled):  # LoRA's reference: each rank's
            settings["ref_model"] = ADAPTERS_OFF  # own base with the adapters off, not this copy
        self.model, self.ranks, self.timeout_s = model, ranks, timeout_s
        self._gpus, self._offload = gpus_per_rank, cpu_offload
        self.shapes = {k: v.shape for k, v in model.state_dict().items()}  # what joined shards must be
        self.untied = tuple(untied(model.state_dict()))  # what the engines get: a tied head once
        self._nbytes = sum(t.numel() * t.element_size() for t in untied(model.state_dict()).values())
        self.sender = RanksSender(self)
        # LoRA: what the engines get and a checkpoint holds is the adapters (the trainable tensors)
        self.adapters = (
            {n: p.shape for n, p in model.named_parameters() if p.requires_grad} if is_peft(model) else None
        )
        self._temperature = float(settings["temperature"])
        self.actors: list[Any] = []
        self._sent: tuple[int, Sequence[Sample]] | None = None  # the last set of rows sent, its key
        ensure_ray()
        bundle = {"CPU": 1.0} | ({"GPU": gpus_per_rank} if gpus_per_rank > 0 else {})
        self.group = placement_group([bundle] * ranks, strategy=placement.upper())
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            need = " and ".join(f"{v * ranks:g} {k}s" for k, v in bundle.items())
            raise LearnerGroupError(
                f"{ranks} learner ranks need {need} in the Ray cluster ({placement.upper()}); "
                f"none came within {timeout_s:.0f} s (runtime.learner_ranks, runtime.learner_placement, "
                "runtime.learner_gpus_per_rank)"
            ) from None
        self.actors = [
            _RankActor.options(
                num_cpus=1,
                num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=r
                ),
            ).remote()
            for r in range(ranks)
        ]
        addr, port = self._wait([self.actors[0].address.remote()], "finding rank 0's address")[0]
        model_ref = ray.put(ModelParts.of(model))
        self._wait(
            [
                a.start.remote(model_ref, settings, r, ranks, addr, port, timeout_s)
                for r, a in enumerate(self.actors)
            ],
            "starting (process group, FSDP shards)",
        )
        self.nodes: list[str] = self._wait([a.node.remote() for a in self.actors], "naming its node")

    def describe(self) -> str:
        """One line for the run's log: how many ranks on how many nodes, computing on what."""
        each = f"{self._gpus:g} GPU (NCCL)" if self._gpus > 0 else "one CPU and one thread (gloo)"
        offload = "; optimizer state in host memory" if self._offload else ""
        return (
            f"learner: {self.ranks} FSDP2 ranks on {len(set(self.nodes))} Ray node(s), {each} each{offload}"
        )

    # ---- calls into the group ----------------------------------------------------------

    def _wait(self, refs: list[Any], doing: str) -> list[Any]:
        """Every rank's answer, or one line naming the first rank that died or did not answer."""
        pending = list(refs)
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.timeout_s)
        for r, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self.close()
                    kind = type(exc).__name__
                    raise LearnerGroupError(
                        f"learner rank {r} of {self.ranks} failed while {doing} ({kind}: "
                        f"{str(exc).strip().splitlines()[-1][:300]})"
                    ) from None
        if pending:
            hung = [r for r, ref in enumerate(refs) if ref in pending]
            self.close()
            raise LearnerGroupError(
                f"learner rank(s) {hung} of {self.ranks} did not finish {doing} within "
                f"{self.timeout_s:.0f} s (runtime.learner_timeout_s)"
            )
        return ray.get(refs)

    def _all(self, doing: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait([a.call.remote(method, *args, **kwargs) for a in self.actors], doing)

    def _on_rows(
        self, doing: str, method: str, rows: Sequence[Sample], *args: Any, **kwargs: Any
    ) -> list[Any]:
        """`_all` with the rows first: a set already sent (the same object as the last call's) is
        named by its key instead of travelling again; a new one is put in the object store once."""
        if self._sent is not None and self._sent[1] is rows:
            key, ref = self._sent[0], None
        else:
            key, ref = (self._sent[0] + 1 if self._sent else 0), ray.put(list(rows))
            self._sent = (key, rows)
        calls = [a.call_on_rows.remote(method, key, ref, *args, **kwargs) for a in self.actors]
        return self._wait(calls, doing)

    # ---- the Learner protocol -------------------------------------------------------------

    @property
    def temperature(self) -> float:
        return self._temperature

    def compute(self, rows: Sequence[Sample], **flags: bool) -> Computed:
        return self._on_rows("computing log-probs", "compute", rows, **flags)[0]

    def update(
        self,
        rows: Sequence[Sample],
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
        old_values: Sequence[Sequence[float]] | None = None,
        envs: Sequence[str] | None = None,
    ) -> dict[str, float]:
        if not rows:
            return {"actor/optimizer_steps": 0.0}
        state = generator.get_state()
        stats = self._on_rows(
            "updating",
            "update_from",
            rows,
            state,
            epochs=epochs,
            mini_batches=mini_batches,
            old_values=old_values,
            envs=list(envs) if envs is not None else None,  # grad_share/<env>: norms of DTensor grads
        )[0]
        for _ in range(epochs):  # this generator draws what the ranks' copies drew
            minibatches(len(rows), mini_batches, generator)
        return stats

    def weights(self, version: int) -> WeightUpdate:
        if self.adapters is not None:  # LoRA: the adapters alone, merged by the engines
            self._pull_adapters()
            return WeightUpdate.of_adapter(adapter_update(self.model), version)
        # no gather here: a weights group's broadcast sends from rank 0 (`remote`), and only an
        # engine in this process (or the object store's path) gathers, once per version
        sender = self.sender
        return WeightUpdate(
            version,
            self.untied,
            lambda: sender.gather(version, BUCKET_BYTES),
            nbytes=self._nbytes,
            remote=sender,
        )

    def _full(self) -> dict[str, torch.Tensor]:
        from steprl.training.learn.rank_learner import join_shards  # noqa: PLC0415 - torch.distributed

        parts = self._all("gathering the weights", "local_state")
        return join_shards(parts, self.shapes)

    def _pull_adapters(self) -> dict[str, torch.Tensor]:
        """The ranks' adapters joined and written into this process's copy of the policy (the
        base never changes): a few MB, not the model."""
        from steprl.training.learn.rank_learner import join_shards  # noqa: PLC0415 - torch.distributed

        assert self.adapters is not None
        parts = self._all("gathering the adapters", "local_state", list(self.adapters))
        joined = join_shards(parts, self.adapters)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in joined.items():
                params[name].copy_(t)
        return joined

    def apply(self, levers: LearnerLevers) -> None:
        self._all("setting the levers", "apply", levers)

    def snapshot(self) -> dict[str, Any]:
        return {"ranks": self._all("taking a snapshot", "snapshot")}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        # taken in one process or on another number of ranks (a resumed run): resharded here
        shards = snapshot_layout.for_ranks(snapshot, self.ranks)["ranks"]
        self._wait(
            [a.call.remote("restore", s) for a, s in zip(self.actors, shards, strict=True)], "restoring"
        )

    def state_dict(self) -> dict[str, Any]:
        state = self._all("gathering the checkpoint", "state_dict")[0]
        if self.adapters is not None:  # LoRA: the exact adapters, as one process writes them
            state["adapters"] = {k: v.clone() for k, v in self._pull_adapters().items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any], checkpoint: Path) -> None:
        if state.get("sharded"):  # written by ranks: each rank reads its shards, resharded to N
            stepped = bool(state.get("sharded_optimizer", True))
            self._all("loading the checkpoint's shards", "load_sharded", str(checkpoint), stepped)
            return
        optimizer = state["optimizer"]
        head = {f"{sharded_state.HEAD}.{k}": v for k, v in (state.get("value_head") or {}).items()}
        if not state.get("ranks"):  # written by one process (keyed by parameter index): reshard
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            optimizer = optimizer_state.by_name(optimizer, names + list(head))
        if state.get("adapters") is not None:  # LoRA: the base is as it started, the adapters saved
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for n, t in state["adapters"].items():
                    params[n].copy_(t)
        else:
            ckpt.load_model_weights(self.model, checkpoint)
        full = {k: v.detach().clone() for k, v in self.model.state_dict().items()} | head
        self._all("loading the checkpoint", "load_full", full, optimizer)

    def save_model(self, directory: Path, final: Path) -> None:
        """The ranks' shards of the weights and optimizer state (`learner/`, written by the
        ranks in parallel; a shared filesystem across nodes), then the policy in HF format."""
        self._all("writing the checkpoint's shards", "save_sharded", str(directory))
        if self.adapters is not None:
            self._pull_adapters()
        else:
            self.model.load_state_dict(self._full())
        ckpt.write_model(self.model, directory, final)

    def close(self) -> None:
        """Kill the ranks and free their placement (twice is fine)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if getattr(self, "group", None) is not None:
            remove_placement_group(self.group)
            self.group = None


__all__ = ["LearnerGroup", "LearnerGroupError"]
