"""Action parsing: both call styles, answers, every malformed case, and a fuzz test via the env."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steprl.envs.library.calculator import CalculatorEnv
from steprl.envs.parsing import (
    ActionSyntax,
    FinalAnswer,
    InvalidAction,
    ToolCall,
    action_kind,
    parse_action,
    stop_strings,
)
from steprl.types import Task

SYNTAX = ActionSyntax(
    tag_tools={"calc": "expression", "search": "query"}, json_tools=frozenset({"calc", "search", "lookup"})
)


def parse(text: str):
    return parse_action(text, SYNTAX)


def reason(text: str, syntax: ActionSyntax = SYNTAX) -> str:
    action = parse_action(text, syntax)
    assert isinstance(action, InvalidAction), action
    return action.reason


# --- valid actions ---------------------------------------------------------------------------


def test_tag_call_binds_body_to_the_single_argument():
    assert parse("<calc>3+4</calc>") == ToolCall("calc", {"expression": "3+4"}, "tag")
    assert parse("<search>who is x</search>") == ToolCall("search", {"query": "who is x"}, "tag")


def test_json_call_hermes_style():
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>'
    assert parse(text) == ToolCall("calc", {"expression": "3+4"}, "json")
    # a tool with no arguments may omit "arguments"
    assert parse('<tool_call>{"name": "lookup"}</tool_call>') == ToolCall("lookup", {}, "json")


def test_answer_is_stripped():
    assert parse("<answer> 35 \n</answer>") == FinalAnswer("35")


def test_text_before_the_first_tag_and_think_blocks_are_ignored():
    assert parse("I should add first. <calc>3+4</calc>") == ToolCall("calc", {"expression": "3+4"}, "tag")
    assert parse("<think>maybe <answer>1</answer>?</think><answer>2</answer>") == FinalAnswer("2")
    # Qwen3 templates put the opening <think> in the prompt: only the close tag is generated
    assert parse("so <calc>1</calc> is wrong</think><answer>2</answer>") == FinalAnswer("2")
    # an unclosed think block is plain text (generation may have stopped at </calc> inside it)
    assert parse("<think>try <calc>1+1</calc>") == ToolCall("calc", {"expression": "1+1"}, "tag")


def test_trailing_text_without_a_tag_is_ignored():
    assert parse("<answer>7</answer> done.") == FinalAnswer("7")


def test_arguments_are_read_only():
    action = parse("<calc>3+4</calc>")
    assert isinstance(action, ToolCall)
    with pytest.raises(TypeError):
        action.arguments["expression"] = "0"  # type: ignore[index]


def test_action_kind():
    assert action_kind(parse("<calc>1</calc>")) == "tool_call"
    assert action_kind(parse("<answer>1</answer>")) == "answer"
    assert action_kind(parse("nothing")) == "invalid"


# --- invalid actions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "empty action"),
        ("   \n", "empty action"),
        ("the answer is 7", "no call or answer"),
        ("<calc>3+4", "unclosed <calc>"),
        ("<answer>7", "unclosed <answer>"),
        ("<python>print(1)</python>", "unknown tool 'python'"),
        ('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "unknown tool 'python'"),
        ('<tool_call>{"name": "<b>", "arguments": {}}</tool_call>', "unknown tool '?'"),
        ("<calc>1+2</calc><calc>3+4</calc>", "one call or answer per turn"),
        ("<calc>1+2</calc><answer>3</answer>", "one call or answer per turn"),
        ("<calc><calc>1+2</calc></calc>", "nested tag inside <calc>"),
        ("<answer></answer>", "empty answer"),
        ("<answer>  </answer>", "empty answer"),
        ('<tool_call>["calc"]</tool_call>', 'tool_call must be {"name": ..., "arguments": {...}}'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool_call needs a "name" string'),
        ('<tool_call>{"name": "calc", "arguments": "3+4"}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
        (
            '<tool_call>{"name": "calc", "arguments": {"x": NaN}}</tool_call>',
            "bad JSON: NaN is not valid JSON",
        ),
        ('<tool_call>{"name": "calc", "name": "calc"}</tool_call>', "bad JSON: duplicate key 'name'"),
    ],
)
def test_invalid_actions_have_short_reasons(text: str, expected: str):
    assert reason(text) == expected
    assert len(expected) <= 60


def test_truncated_json_reports_the_position():  # reliability BAD-01
    text = '<tool_call>{"name":"calc","arguments":{"expression":"1+1"}</tool_call>'
    assert reason(text).startswith("bad JSON at char ")


def test_pathological_json_never_raises():  # reliability BAD-05
    big = ActionSyntax(tag_tools={}, json_tools=frozenset({"f"}), max_chars=10**7)
    assert reason("<tool_call>" + "[" * 200_000 + "</tool_call>", big).startswith("bad JSON")
    assert reason("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", big) == "bad JSON"
    assert reason("<tool_call>" + "9" * 10_000 + "</tool_call>", big) == "bad JSON"


def test_too_long_actions_are_rejected_up_front():
    assert reason("<calc>" + "1" * 40_000 + "</calc>") == "action too long (max 32768 chars)"


def test_non_text_action_is_invalid():
    assert reason(None) == "action is not text"  # type: ignore[arg-type]


def test_many_open_tags_are_parsed_in_linear_time():
    # regex backtracking over unmatched tags would be quadratic; this must stay fast
    for text in ("<x>" * 10_000, "</x>" * 10_000, "<calc>" * 5_000, "<think>" * 8_000, "<x></y>" * 4_000):
        assert isinstance(parse(text), InvalidAction)


def test_unicode_is_fine():
    assert parse("思考中… <answer>七</answer>") == FinalAnswer("七")
    assert parse("<calc>\ud800</calc>") == ToolCall("calc", {"expression": "\ud800"}, "tag")


# --- syntax and stop strings ---------------------------------------------------------------------


def test_stop_strings():
    assert SYNTAX.stop_strings == ("</calc>", "</search>", "</tool_call>", "</answer>")
    assert stop_strings(["calc"]) == ("</calc>", "</tool_call>", "</answer>")
    assert stop_strings(["calc"], json_calls=False) == ("</calc>", "</answer>")
    # with JSON calls off, <tool_call> is not a recognised tag
    tag_only = ActionSyntax(tag_tools={"calc": "expression"})
    assert tag_only.stop_strings == ("</calc>", "</answer>")
    assert reason('<tool_call>{"name": "calc"}</tool_call>', tag_only) == "unknown tool 'tool_call'"


def test_bad_syntax_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="clash"):
        ActionSyntax(tag_tools={"answer": "x"})
    with pytest.raises(ValueError, match="cannot be used as a tag"):
        ActionSyntax(tag_tools={"a b": "x"})


# --- fuzz: any string is a call, an answer, or answered with an <error> observation ---------------

TASK = Task(id="t", prompt="(3+4)*5", env="calculator", answer="35")
FRAGMENTS = [
    "<calc>",
    "</calc>",
    "<answer>",
    "</answer>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "{",
    "}",
    '"',
    '"name"',
    '"calc"',
    '"arguments"',
    ":",
    ",",
    "3+4",
    "35",
    "[",
    " ",
]
mixed = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=20).map("".join)


def _assert_answered(env: CalculatorEnv, action: str) -> None:
    env.reset(TASK, 0)
    transition = env.step(action)
    kind = transition.info["action_kind"]
    assert sum(transition.info["reward_components"].values()) == transition.reward
    if kind == "answer":
        assert transition.terminated and transition.observation == ""
    elif kind == "tool_call":
        assert transition.observation.startswith(("<result>", "<error>"))
        assert (transition.info["error"] is None) == transition.info["tool_call_valid"]
    else:
        assert kind == "invalid"
        assert transition.observation.startswith("<error>") and transition.observation.endswith("</error>")
        assert transition.info["error"]


@settings(max_examples=1000, deadline=None)
@given(st.text())
def test_fuzz_any_text_never_raises(action: str):
    _assert_answered(CalculatorEnv(), action)


@settings(max_examples=1000, deadline=None)
@given(mixed)
def test_fuzz_tag_soup_never_raises(action: str):
    _assert_answered(CalculatorEnv(), action)
