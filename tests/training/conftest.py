"""Fixtures of the learner tests."""

from dataclasses import replace

import pytest
import torch

from steprl.rollout.context import AppendOnly
from steprl.rollout.views import packed_view


@pytest.fixture
def advantage_rows(sample_rollouts):
    """8 packed training rows of real rollouts, with seeded random advantages on their action tokens."""
    trajs = sample_rollouts(AppendOnly(), n_tasks=4, group_size=2)[:8]
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, t in enumerate(trajs):
        s = packed_view(t, i)
        a = torch.randn(len(s.input_ids), generator=g) * torch.tensor(s.loss_mask, dtype=torch.float32)
        rows.append(replace(s, advantages=tuple(a.tolist())))
    return rows
