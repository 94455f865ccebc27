"""`ChatFormat`: a `PromptFormat` for any tokenizer with a chat template, exact to the token.

The first prompt is the template's render of [system, user task] with the env's tools and the
generation prompt. After that nothing is re-rendered: the model's sampled ids are kept as
sampled, and each env message is appended as the template's *delta*, the text the template adds
for that message after a fixed conversation (SkyRL and verl's "continuous tokens" do the same):

    observation_ids = [end-of-turn, if the model did not sample it] + closing suffix (e.g. "\\n")
                    + message opening (e.g. "<|im_start|>user\\n<tool_response>\\n")
                    + env text, encoded as text (no control ids: `text_tokens.TextEncoder`)
                    + message closing and the next generation prompt

All of it is observation: loss mask 0, so what the template adds after a turn the model did not
end itself (the `\\n` after `<|im_end|>` / `<end_of_turn>`, an end-of-turn when the turn hit
`max_tokens` or stopped at a call's close tag) is context, never a target.

Template pieces are found once, by rendering each message kind around a sentinel: templates
that trim message text (Gemma's) are detected and the text is trimmed the same way. Whether the
incremental ids equal a whole render is what `template_check.check_template` verifies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steprl.errors import UserError
from steprl.rollout.chat import TEXT_ONLY_TAGS, newline_ids, split_stop_strings
from steprl.rollout.text_tokens import TextEncoder

_SENT = "\u2063STEPRL{}\u2063"  # invisible separator: no template touches it, no tokenizer merges across


class ChatTemplateError(UserError):
    """The tokenizer cannot serve as a chat format (no template, or one we cannot take apart)."""


@dataclass(frozen=True)
class _Piece:
    """A message kind's rendered text around its content: `before + content + after`."""

    before: str
    after: str
    trims: bool  # the template strips the content's surrounding whitespace
    controls: int = 0  # control tokens in before + after


class ChatFormat:
    """Prompts and env messages through the tokenizer's chat template (see the module docstring).

    `system_prompt`: "none", "env" (the env's own, read after reset) or a literal text.
    `tool_role`: how a tool result is sent: "auto" picks "tool" when the template renders a
    tool message (Qwen3: `<tool_response>` inside a user turn), else "user" (Gemma has no tool
    role). `template_kwargs` go to every render (e.g. ``{"enable_thinking": False}``).
    """

    #: the agent loop compares a whole re-render with the exact ids (rollout/template_mismatch_rate)
    checks_template = True

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str = "env",
        tool_role: str = "auto",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; set "
                "model.chat_template to a Jinja file, or model.format=plain for a base model without one"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.text = TextEncoder(tokenizer, extra_controls=TEXT_ONLY_TAGS)
        self.eos_token_id: int = int(tokenizer.eos_token_id)
        self._end_turn, self._close = self._turn_end()
        self.end_of_turn_id = self._end_turn
        self.tool_role = self._tool_role() if tool_role == "auto" else tool_role
        self._pieces: dict[str, _Piece] = {
            "user": self._message_piece("user"),
            "tool": self._message_piece(self.tool_role),
        }

    # ---- rendering helpers -------------------------------------------------------------------
    def render(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (), gen: bool
    ) -> str:
        """The template's text for `messages` (tools only when there are some)."""
        out = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) or None,
            tokenize=False,
            add_generation_prompt=gen,
            **self.template_kwargs,
        )
        return str(out)

    def template_ids(self, text: str) -> tuple[int, ...]:
        """Template text (special-token strings are control tokens here, as the template means)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    def _turn_end(self) -> tuple[int, tuple[int, ...]]:
        """(end-of-turn id, what the template adds after it): from a one-exchange render."""
        mark = _SENT.format("A")
        text = self.render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}], gen=False
        )
        if mark not in text:
            raise ChatTemplateError("the chat template drops assistant text; it cannot be used to train on")
        tail = self.template_ids(text.split(mark, 1)[1])
        if not tail:
            raise ChatTemplateError(
                "the chat template ends an assistant turn with nothing; an end-of-turn token is needed"
            )
        return tail[0], tail[1:]

    def _tool_role(self) -> str:
        mark = _SENT.format("T")
        try:
            text = self.render(
                [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "tool", "content": mark},
                ],
                gen=True,
            )
        except Exception:  # a template that raises on an unknown role has no tool role
            return "user"
        return "tool" if mark in text else "user"

    def _message_piece(self, role: str) -> _Piece:
        """`role`'s text after a finished turn: the render with the message, minus the render
        without it. Two bases are tried, since templates differ in what they re-render: after a
        whole exchange (Gemma), or after a user turn (Qwen3 renders its last assistant turn with
        an empty `<think>` block, which it drops once another message follows)."""
        mark = _SENT.format("M")
        for base in (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            [{"role": "user", "content": "hi"}],
        ):
            prefix = self.render(base, gen=False)
            try:
                full = self.render([*base, {"role": role, "content": f" \n{mark}\n "}], gen=True)
            except Exception:  # e.g. a template that forbids two user turns in a row
                continue
            if full.startswith(prefix):
                break
        else:
            raise ChatTemplateError(
                f"the chat template re-renders earlier turns when a {role} message follows (the render "
                f"of [user, assistant] is not a prefix of the render with a {role} message after them), "
                "so env messages cannot be appended as deltas; fix the template (model.chat_template)"
            )
        delta = full[len(prefix) :]
        head, sep, tail = delta.partition(mark)
        if not sep:
            raise ChatTemplateError(f"the chat template drops the text of a {role} message")
        # the mark was sent as " \n<mark>\n ": a template that trims content rendered it bare
        trims = not (head.endswith(" \n") and tail.startswith("\n "))
        if not trims:
            head, tail = head[: -len(" \n")], tail[len("\n ") :]
        controls = self.text.controls_in(self.template_ids(head)) + self.text.controls_in(
            self.template_ids(tail)
        )
        return _Piece(head, tail, trims, controls)

    # ---- PromptFormat -------------------------------------------------------------------------
    def initial_ids(
        self, system_prompt: str, observation: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[int, ...]:
        """[system?, user task] rendered with the tools and the generation prompt. Env text with
        a control-token string in it is encoded as text, piece by piece (BAD-09); other text is
        tokenized with the template in one piece, as a whole render is."""
        instructions = {"none": "", "env": system_prompt}.get(self.system_prompt, self.system_prompt)
        trims = self._pieces["user"].trims
        contents = [
            c.strip() if trims else c for c in ((instructions,) if instructions else ()) + (observation,)
        ]
        roles = ["system", "user"] if instructions else ["user"]
        if all(self.text.is_plain(c) for c in contents):
            messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            return self.template_ids(self.render(messages, tools=tools, gen=True))
        marks = [_SENT.format(r[0].upper()) for r in roles]
        rest = self.render(
            [{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)], tools=tools, gen=True
        )
        ids: list[int] = []
        for mark, content in zip(marks, contents, strict=True):
            head, sep, rest = rest.partition(mark)
            if not sep:
                raise ChatTemplateError("the chat template drops a message's text")
            ids += self.template_ids(head)
            ids += self.text.encode(content)
        ids += self.template_ids(rest)
        return tuple(ids)

    def observation_ids(
        self, text: str, *, action_ids: Sequence[int] = (), tool_result: bool = True
    ) -> tuple[int, ...]:
        """The ids appended after an assistant turn: the end of that turn the model did not sample,
        then the env's message (a tool result, or a user turn) and the next generation prompt."""
        piece = self._pieces["tool" if tool_result else "user"]
        ended = bool(action_ids) and action_ids[-1] == self._end_turn
        closing = self._close if ended else (self._end_turn, *self._close)
        body = text.strip() if piece.trims else text
        if self.text.is_plain(body):  # one piece, as in a whole render
            ids = self.template_ids(piece.before + body + piece.after)
            # ...unless text and template meet in a control string ("<tool_response" + ">")
            if self.text.controls_in(ids) == piece.controls:
                return (*closing, *ids)
        return (
            *closing,
            *self.template_ids(piece.before),
            *self.text.encode(body),
            *self.template_ids(piece.after),
        )

    def message_ids(self, text: str, *, tool_result: bool = True) -> tuple[int, ...]:
        """The env text's own ids inside `observation_ids` (what decodes back to the text)."""
        piece = self._pieces["tool" if tool_result else "user"]
        return self.text.encode(text.strip() if piece.trims else text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def decode_all(self, ids: Sequence[int]) -> str:
        """Every token's text, special ones included (for diagnostics)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def think_close_ids(self) -> tuple[int, ...]:
        return self.template_ids("</think>")

    def newline_ids(self) -> frozenset[int]:
        return newline_ids(self.template_ids)

    def rerender_ids(
        self,
        system_prompt: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[int, ...]:
        """The ids of a whole render of [system?] + `messages` with the generation prompt,
        tokenized in one piece: what a harness that re-templates every turn would feed the model
        (`rollout/template_mismatch_rate` compares it with the exact ids)."""
        instructions = {"none": "", "env": system_prompt}.get(self.system_prompt, self.system_prompt)
        head = [{"role": "system", "content": instructions}] if instructions else []
        sent = [{**m, "role": self.tool_role} if m["role"] == "tool" else dict(m) for m in messages]
        return self.template_ids(self.render([*head, *sent], tools=tools, gen=True))

    def stop_tokens(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """End-of-turn and EOS ids, plus the env's stop strings: one id when the string is a token
        of its own (Qwen3's `</tool_call>`), else a token sequence matched on the output's end."""
        return split_stop_strings(self.template_ids, stop_strings, always=(self._end_turn, self.eos_token_id))
