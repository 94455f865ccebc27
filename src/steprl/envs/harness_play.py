"""Example harnesses: a steprl env played through a chat client, as a plain script with the
`openai` client would play it (`env.name: harness`, `env.params.run:
steprl.envs.harness_play:calculator`).

The harness sees text only: it sends the conversation as messages, gets the reply's content,
hands it to the env and appends the env's answer as a tool result (or a user turn, for the
env's reply to an answer). It never sees a token id; the gateway recovers them. With the same
seed it asks for the same turns the agent loop would (tests/gateway/test_harness.py checks the
two give the same trajectories), so it is also how the gateway is checked against the loop.
The env is reset with the task's own seed (a harness is not told the episode's seed).
"""

from __future__ import annotations

from typing import Any

from steprl.envs.base import env_tools, maybe_await
from steprl.envs.registry import make_env
from steprl.types import Task


async def play(env_name: str, task: Task, client: Any, *, system: bool = False, **env_params: Any) -> float:
    """Play `task` on a fresh `env_name` env through `client` (an `openai.AsyncOpenAI`); returns
    the sum of the env's rewards. `system`: send the env's system prompt (a chat model's run;
    the tiny model's runs have none). A call the gateway refuses (a spent turn or token budget)
    raises, and the episode ends truncated."""
    env = make_env(env_name, **env_params)
    try:
        first = await maybe_await(env.reset(task, task.seed))
        messages: list[dict[str, Any]] = []
        if system and str(getattr(env, "system_prompt", "")):
            messages.append({"role": "system", "content": env.system_prompt})
        messages.append({"role": "user", "content": first.text})
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
            }
            for t in env_tools(env).values()
        ]
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        if getattr(env, "stop_strings", ()):
            extra["stop"] = list(env.stop_strings)
        total = 0.0
        while True:  # until the env ends the episode, or the gateway refuses a call
            reply = await client.chat.completions.create(model="policy", messages=messages, **extra)
            text = reply.choices[0].message.content or ""
            step = await maybe_await(env.step(text))
            total += float(step.reward)
            if step.terminated or step.truncated:
                return total
            role = step.info.get("role") or ("user" if step.info.get("action_kind") == "answer" else "tool")
            messages += [{"role": "assistant", "content": text}, {"role": role, "content": step.observation}]
    finally:
        await maybe_await(env.close())


async def calculator(task: Task, client: Any) -> float:
    """The calculator env (`<calc>` calls, `<answer>`), as a harness."""
    return await play("calculator", task, client)


async def bandit(task: Task, client: Any) -> float:
    """The two-armed bandit (one answer), as a harness."""
    return await play("bandit", task, client, reward="best")
