"""The policy gateway (`steprl serve-policy`): an OpenAI-compatible endpoint in front of a run's
engine that records each call's exact token ids and log-probs for training (`sessions.py`: append
or branch, provenance checked; `policy_gateway.py`: the calls; `openai_format.py`: the API's
shapes, `anthropic_format.py`: Anthropic's Messages API; `app.py`: the HTTP routes, the `serve`
extra)."""
