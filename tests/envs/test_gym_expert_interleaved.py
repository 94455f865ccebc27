"""The Gymnasium expert is shared by concurrent episodes (SFT demos, GRPO groups): interleaved
episodes of one task that share actions but not slips must each get their own state's move."""

from __future__ import annotations

import random
from itertools import islice

from steprl.envs.adapters.gym_yaml import gym_spec


def test_interleaved_slippery_episodes_of_one_task_get_their_own_moves() -> None:
    spec = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": True}, "max_turns": 30})
    task = next(islice(spec.tasks("train", 0), 1))
    shared = spec.strategies["expert"]
    envs = [spec.factory(), spec.factory()]
    histories: list[list[tuple[str, str]]] = [[], []]
    for env, seed in zip(envs, (11, 12), strict=True):
        env.reset(task, seed)  # same start, different slips
    done = [False, False]
    mismatches = checked = 0
    for _ in range(30):
        for i, env in enumerate(envs):
            if done[i]:
                continue
            move = shared(task, histories[i], random.Random(0))
            # a fresh expert, replaying this episode alone, is the reference
            fresh = gym_spec({"id": "FrozenLake-v1", "kwargs": {"is_slippery": True}, "max_turns": 30})
            reference = fresh.strategies["expert"](task, histories[i], random.Random(0))
            mismatches += move != reference
            checked += 1
            t = env.step(move)
            histories[i].append((move, t.observation))
            done[i] = t.terminated or t.truncated
        if all(done):
            break
    assert checked > 4 and mismatches == 0
