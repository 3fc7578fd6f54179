"""model/plan.py: a model's step as stages, the list both the per-op walk and the compiled step
run (tests/backend/test_cpu_step.py holds their logits equal bit for bit)."""

from __future__ import annotations

import numpy as np

from daemon.model.plan import FFN, HEAD, MIXER, LayerPlan


def test_each_layer_is_a_mixer_then_an_ffn_and_the_head_ends_the_plan():
    plan = LayerPlan.of(3)
    assert list(plan) == [(MIXER, 0, 0), (FFN, 0, 0), (MIXER, 1, 0), (FFN, 1, 0), (MIXER, 2, 1), (FFN, 2, 0),
                          (HEAD, -1, 0)]
    assert plan.stages.dtype == np.int64 and plan.stages.flags.c_contiguous


def test_a_family_that_keeps_every_row_never_trims():
    assert [t for _, _, t in LayerPlan.of(4, last_layer_all_rows=True)] == [0] * 9


def test_an_ffn_norms_the_next_stage_input_across_the_layer_boundary():
    plan = LayerPlan.of(2)
    assert plan.ffn_stage(0) == 1 and plan.ffn_stage(1) == 3
    assert plan.next_layer(plan.ffn_stage(0)) == 1  # the next layer's attention norm
    assert plan.next_layer(plan.ffn_stage(1)) == -1  # the output norm, before HEAD
