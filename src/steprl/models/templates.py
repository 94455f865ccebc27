"""Chat templates steprl supplies for tokenizers that come without one.

The Gemma 3 GGUF of the `gemma` extra carries no chat template, so steprl writes the turn format
Google documents for Gemma 3 (https://ai.google.dev/gemma/docs/core/prompt-structure):

    <bos><start_of_turn>user
    {system}

    {first user message}<end_of_turn>
    <start_of_turn>model
    {reply}<end_of_turn>

Gemma has two roles, `user` and `model`, and no system role: a system message opens the first
user turn, followed by a blank line. Gemma has no tool role either, so a tool result is a user
turn. Turn content is trimmed (each text part of a list), the system text is not, as in Google's
own template; on alternating user/model conversations the two render the same text. Each turn
renders the same whatever follows it, so the ids of conv[:k] are a prefix of the ids of
conv[:k+1] (tested), which is what exact multi-turn token deltas need.
"""

from __future__ import annotations

#: Gemma 3 turns; `assistant` -> `model`, `tool` -> `user`, the system message joins the first turn.
#: Content may be a string or a list of {"type": "text", "text": ...} parts (each trimmed, joined);
#: this model reads text only, so other parts (images) are dropped.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string or message['content'] is none -%}"
    "{%- set text = message['content'] or '' -%}"
    "{%- else -%}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | map('trim') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- set ns.system = text ~ '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] in ('assistant', 'model') else 'user' -%}"
    "{{- '<start_of_turn>' ~ role ~ '\\n' ~ ns.system ~ (text | trim) ~ '<end_of_turn>\\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<start_of_turn>model\\n' -}}"
    "{%- endif -%}"
)
