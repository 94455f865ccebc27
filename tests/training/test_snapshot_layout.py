"""A rollback snapshot moves between learner layouts exactly (`snapshot_layout.py`): one process
and N ranks, FSDP2's dim-0 chunks (uneven, and empty past the last)."""

from __future__ import annotations

import torch

from steprl.training.learn import snapshot_layout as layout


def test_snapshots_reshard_between_one_process_and_any_number_of_ranks():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g), torch.randn(1, 4, generator=g)]
    state = {
        i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(p.shape, generator=g), "exp_avg_sq": p.abs()}
        for i, p in enumerate(params)
        if i != 1  # a parameter that has not stepped: no state
    }
    one = {
        "params": params,
        "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]},
    }
    on_two = layout.for_ranks(one, 2)
    assert [p.shape[0] for p in on_two["ranks"][1]["params"]] == [2, 1, 0]  # torch.chunk's split
    on_four = layout.for_ranks(on_two, 4)  # a run resumed on 4 ranks keeps the 2 ranks' ring
    assert [p.shape[0] for p in on_four["ranks"][3]["params"]] == [0, 0, 0]
    back = layout.for_one(on_four, one["optimizer"]["param_groups"])
    assert all(torch.equal(a, b) for a, b in zip(back["params"], params, strict=True))
    assert set(back["optimizer"]["state"]) == {0, 2}
    for i, saved in state.items():
        for k, v in saved.items():
            assert torch.equal(back["optimizer"]["state"][i][k], v), (i, k)
    assert layout.for_ranks(on_two, 2) == on_two  # already in that form: as it is
