"""A Hugging Face `transformers` engine: batched, KV-cached sampling with per-token log-probs.

Concurrent `generate` calls (one per live trajectory) are queued; one scheduler task runs a
continuously batched decode (`decode.py`): waiting requests are prefilled and join between
decode steps, a finished row leaves at once, a trajectory's next turn prefills only its new
tokens (`prefix_cache.py`) and a group's identical prompts are prefilled once. The cache is
written in place (`kv_cache.py`). CPU by default; the device is configurable.

Sampling is seeded per request (`sampling.py`). The agent loop gives every turn of every
episode its own seed; the engine turns (engine seed, request seed, token index) into one uniform
number with a counter-based hash and samples by inverse CDF. So which tokens a trajectory gets
does not depend on which other requests shared its batch, when they joined, or in which order
envs answered: an env behind an HTTP server or in a Ray actor gives the same rollouts as an
in-process one, up to float rounding in the batched forward pass (~1e-7 in the logits on CPU).
Requests without a seed draw from the engine's generator, in batch order.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from steprl.engines import delta
from steprl.engines.base import Generation, SamplingParams
from steprl.engines.decode import Request, RunningBatch
from steprl.engines.kv_cache import engine_cache, preloadable
from steprl.engines.lora_merge import LoraMerger
from steprl.engines.prefix_cache import PrefixCache
from steprl.engines.sampling import request_uniforms, sample_from_logits
from steprl.engines.snapshots import CrossPolicy, Snapshots, draw_lags
from steprl.engines.weights import AnyUpdate, WeightSyncError, WeightUpdate, load_update

#: Waiting requests join a running batch only if it may still decode more steps than this:
#: closer to its end, they lose less by waiting than a join (a prefill and a cache copy) costs.
JOIN_MIN_STEPS = 4


@dataclass(frozen=True)
class EngineSettings:
    """How a run's engines batch, cache and sample: one record (`training/setup/rollout_parts.py`
    builds it from the config) for every engine of a run, in-process and on Ray rollout workers,
    so their settings cannot drift apart. Where the weights live (device, dtype) is not here: that
    is each process's own."""

    max_batch_size: int = 256
    seed: int = 0  # every request carries its own seed too (`rollout/seeds.py`)
    prefix_cache_bytes: int = 1 << 30  # 0: re-prefill every turn
    continuous: bool = True  # False: a batch runs until its last row finishes
    #: cross-policy sampling (`snapshots.py`): None, or K versions held and each one's chance
    cross_policy: CrossPolicy | None = None


class HFEngine:
    """Serves a `transformers` causal LM to many concurrent trajectories."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        prefix_cache_bytes: int = 1 << 30,
        continuous: bool = True,
        cross_policy: CrossPolicy | None = None,
    ) -> None:
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.continuous = continuous  # False: a batch runs until its last row finishes
        self.generator = torch.Generator().manual_seed(seed)  # requests without a seed
        self.seed = seed
        self._version = version
        # transformers 5 renamed the KV-cache argument `past_key_values` -> `cache`
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self._queue: list[Request] = []
        self._batcher: asyncio.Task[None] | None = None
        self.tokens_generated = 0
        self.forward_passes = 0
        self._lora: LoraMerger | None = None  # holds W0 once adapter updates arrive (LoRA)
        # keys/values of each row's context, for its trajectory's next turn (full-attention models)
        self._prefix = (
            PrefixCache(prefix_cache_bytes)
            if prefix_cache_bytes > 0 and preloadable(engine_cache(self.model))
            else None
        )
        # K > 1: the K-1 versions before this one, each its own engine (snapshots.py)
        self.snapshots: Snapshots | None = None
        if cross_policy is not None and cross_policy.snapshots > 1:
            self.snapshots = Snapshots(cross_policy, self._snapshot_engine)
            self._settings = (max_batch_size, seed, prefix_cache_bytes, continuous)
            self._draws = torch.Generator().manual_seed(seed ^ 0x5EED)  # requests without a seed

    def _snapshot_engine(self, model: torch.nn.Module, version: int) -> HFEngine:
        batch, seed, prefix, continuous = self._settings
        return HFEngine(
            model,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            device=str(self.device),
            max_batch_size=batch,
            seed=seed,  # the same token draws: only the weights differ
            version=version,
            prefix_cache_bytes=prefix,
            continuous=continuous,
        )

    @classmethod
    def with_settings(
        cls,
        model: torch.nn.Module,
        settings: EngineSettings,
        *,
        eos_token_id: int,
        pad_token_id: int,
        device: str = "cpu",
        version: int = 0,
    ) -> HFEngine:
        """An engine with a run's `settings` (how every engine of a run is built)."""
        return cls(
            model,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            device=device,
            max_batch_size=settings.max_batch_size,
            seed=settings.seed,
            version=version,
            prefix_cache_bytes=settings.prefix_cache_bytes,
            continuous=settings.continuous,
            cross_policy=settings.cross_policy,
        )

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        """Load new policy weights in place and bump the policy version. Call it on the
        engine's event loop (or while it is idle): the scheduler yields between decode steps, so
        rows in flight keep decoding with the new weights (a partial rollout; every token
        records its version) over the keys and values the old ones computed.

        Full weights (a `WeightUpdate`'s buckets, checked in order, or a state dict) are
        copied in place (shapes must match). An adapter (LoRA) merges into this plain copy:
        W = W0 + scaling * B @ A, from the base weights W0 kept at the first adapter update, so
        updates never accumulate.

        With cross-policy snapshots, a new version first keeps the current (merged) weights as
        the newest snapshot; the same version again (LoRA's first merge, a resume) replaces them.
        """
        if isinstance(state_dict, WeightUpdate) and state_dict.delta_from is not None:
            if state_dict.delta_from != self._version:  # the XOR is against another version
                raise WeightSyncError(
                    f"a delta from version {state_dict.delta_from} to {state_dict.version} reached an "
                    f"engine holding version {self._version}"
                )
            state_dict = delta.applied(state_dict, self.model.state_dict())
        if self.snapshots is not None and version != self._version:
            self.snapshots.rotate(self.model, self._version)
        self._lora = load_update(self.model, state_dict, self._lora)
        self._version = version
        if self._prefix is not None:  # keys and values of the old weights
            self._prefix.clear()

    def snapshot_state(self) -> dict[str, Any]:
        """The cross-policy snapshots (versions, weights) and the current version: a checkpoint's."""
        held = self.snapshots.state_dict() if self.snapshots is not None else {"versions": [], "weights": []}
        return {"version": self._version, **held}

    def load_snapshots(self, state: Mapping[str, Any]) -> None:
        """Hold `state`'s snapshots, at its current version (whose weights come next, by an
        `update_weights` of that same version, which then keeps the snapshots as they are)."""
        if self.snapshots is not None:
            self.snapshots.load_state_dict(state, self.model)
        self._version = int(state["version"])

    #: the model's own positions bound it (an HF engine holds what the model holds)
    max_positions: int | None = None

    def close(self) -> None:
        """Nothing to release: the model is this process's."""

    def reset_scheduler(self) -> None:
        """Forget queued requests and the scheduler task (their event loop is being closed)."""
        self._queue = []
        self._batcher = None
        if self.snapshots is not None:
            self.snapshots.reset_scheduler()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        seed: int | None = None,
        cross_policy: bool = True,
    ) -> Generation:
        """`cross_policy=False`: the current weights whatever the snapshots (evaluation)."""
        if not prompt_ids:
            raise ValueError("generate() needs a non-empty prompt (start it with a BOS token).")
        if self.snapshots is not None and cross_policy:
            if seed is not None:
                lag = draw_lags(self.snapshots.policy, self.seed, [seed])[0]
            else:
                u = torch.rand((), generator=self._draws, dtype=torch.float64)
                lag = draw_lags(self.snapshots.policy, self.seed, [int(u * 2**53)])[0]
            older = self.snapshots.engine_for(lag) if lag else None
            if older is not None:
                return await older.generate(prompt_ids, sampling, seed=seed)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(Request(tuple(prompt_ids), sampling, future, seed))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await future

    async def _settle(self) -> None:
        """Let every runnable trajectory submit its request before a batch is cut."""
        pending = -1
        while pending != len(self._queue):
            pending = len(self._queue)
            for _ in range(3):
                await asyncio.sleep(0)

    async def _run_batches(self) -> None:
        """The scheduler: one running batch; waiting requests join it between decode steps,
        finished rows leave it (their callers resume at once)."""
        batch = RunningBatch(self)
        while self._queue or len(batch):
            if not len(batch):
                await self._settle()
            # a caller that gave up while waiting (a cancel) is never prefilled
            self._queue = [r for r in self._queue if r.future is None or not r.future.done()]
            room = self.max_batch_size - batch.live
            joining = [r for r in self._queue if batch.accepts(r.sampling)][:room]
            # a join costs a prefill pass and a copy of the cache: worth it once the waiting
            # requests are a good share of the batch and the batch may still run a while (or
            # nothing else is decoding)
            if (
                joining
                and batch.live
                and not (
                    self.continuous and len(joining) * 2 >= batch.live and batch.steps_left() > JOIN_MIN_STEPS
                )
            ):
                joining = []
            try:
                if joining:
                    taken = {id(r) for r in joining}
                    self._queue = [r for r in self._queue if id(r) not in taken]
                    batch.admit(joining)
                finished = batch.step()
            except Exception as exc:  # surface to every waiter instead of hanging them
                for r in [*joining, *(row.request for row in batch.rows)]:
                    if r.future is not None and not r.future.done():
                        r.future.set_exception(exc)
                batch = RunningBatch(self)
                continue
            for request, generation in finished:
                if request.future is not None and not request.future.done():
                    request.future.set_result(generation)
            # finished rows: their episodes step their envs and may ask again, let them join now;
            # otherwise one yield, so that a weight update from the trainer (asynchronous
            # training) lands between two decode steps, never inside a forward pass
            for _ in range(3 if finished else 1):
                await asyncio.sleep(0)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[tuple[int, ...]], sp: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Generation]:
        """Generate for `prompts` as one batch, outside the scheduler (tests, benchmarks)."""
        requests = [
            Request(tuple(p), sp, None, s)
            for p, s in zip(prompts, seeds or [None] * len(prompts), strict=True)
        ]
        batch = RunningBatch(self)
        batch.admit(requests)
        done: dict[int, Generation] = {}
        while len(batch):
            done.update({id(r): g for r, g in batch.step()})
        return [done[id(r)] for r in requests]


class CurrentPolicy:
    """`engine` without its cross-policy snapshots: every request on the current weights
    (held-out evaluation measures the policy being trained, not the mixture)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        return await self.engine.generate(prompt_ids, sampling, seed=seed, cross_policy=False)

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        self.engine.update_weights(state_dict, version)


async def probe_answer(engine: Any, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
    """`engine`'s answer to the weight-sync probe: on its current weights (not a cross-policy
    snapshot), each token marked with the version the engine says it holds where it marks none
    (vLLM marks a request's tokens only when they span versions)."""
    current = CurrentPolicy(engine) if getattr(engine, "snapshots", None) is not None else engine
    gen: Generation = await current.generate(prompt_ids, sampling, seed=0)
    return gen if gen.versions else replace(gen, versions=(engine.version,) * len(gen.token_ids))


__all__ = [
    "CurrentPolicy",
    "EngineSettings",
    "HFEngine",
    "probe_answer",
    "request_uniforms",
    "sample_from_logits",
]
