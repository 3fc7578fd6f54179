"""The host tier's promotion rule (daemon/experts/promotion.py), by hand-computed cases."""

import numpy as np

from daemon.experts import promotion


def test_the_best_candidates_take_the_weakest_slots_while_they_clearly_win():
    score = np.array([1.0, 0.0, 9.0, 5.0, 3.0])  # experts 0, 1 in slots 0, 1
    holder = np.array([0, 1])
    held = np.array([True, True, False, False, False])
    # 9 > 2*0 + 2 takes slot 1 (holder 1, the weakest); 5 > 2*1 + 2 takes slot 0
    assert promotion.moves(score, holder, held, 4) == [(1, 2), (0, 3)]
    assert promotion.moves(score, holder, held, 1) == [(1, 2)]
    assert promotion.moves(score, holder, held, 0) == []


def test_noise_moves_nothing_and_experts_on_their_way_are_not_chosen_again():
    holder = np.array([0, 1])
    held = np.array([True, True, False, False])
    assert promotion.moves(np.array([2.0, 2.0, 6.0, 5.0]), holder, held, 4) == []  # 6 <= 2*2 + 2
    held_or_moving = np.array([True, True, True, False])  # expert 2 already on its way
    assert promotion.moves(np.array([0.0, 0.0, 9.0, 3.0]), holder, held_or_moving, 4) == [(0, 3)]
    assert promotion.moves(np.array([1.0, 2.0]), np.array([], np.int64), np.zeros(2, bool), 4) == []


def test_scores_decay_and_add_the_counts():
    np.testing.assert_allclose(promotion.decayed(np.array([10.0, 0.0]), np.array([0, 3])), [9.0, 3.0])


def test_an_empty_slot_takes_any_candidate_over_the_margin():
    holder = np.array([-1, 1])  # slot 0 empty (a failed copy)
    held = np.array([False, True, False])
    assert promotion.moves(np.array([3.0, 50.0, 1.0]), holder, held, 4) == [(0, 0)]  # 3 > 2; 1 does not beat 50
    assert promotion.moves(np.array([1.0, 50.0, 0.0]), holder, held, 4) == []  # 1 <= 2
