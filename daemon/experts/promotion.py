"""Which experts move into a tier's slots between steps, from counted use (the host tier's VRAM
slots, backend/cuda_host_tier.py): a decayed frequency per expert, and a move only where the
newcomer clearly beats the slot's holder, so that noise (uniform routing) does not churn copies.

    score [E]   decayed use: score * DECAY + the counts read since
    holder [S]  the expert in each slot

A candidate (not held, best score first) takes the weakest holder's slot when its score exceeds
RATIO * the holder's + MARGIN; an empty slot (holder -1: a failed copy left it) takes any
candidate scoring over MARGIN. With 25% of the experts in the slots (benchmarks/
host_tier_promotion.py), against the plain rule `score > holder + 1`, it keeps 97% (kimi trace) and
93% (olmoe) of the hit-rate gain over no promotion, with 0.2-0.4x its moves under uniform routing,
where no rule gains hits and every move is a copy over PCIe.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.9  # a score's weight per read of the counts
RATIO = 2.0
MARGIN = 2.0


def decayed(score: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return score * DECAY + counts


def moves(score: np.ndarray, holder: np.ndarray, held: np.ndarray, most: int) -> list[tuple[int, int]]:
    """Up to `most` (slot, expert) moves: the best candidates against the weakest holders, while
    each candidate beats its victim. held [E] bool: experts in a slot or on their way there."""
    if most <= 0 or not holder.size:
        return []
    order = np.argsort(-score, kind="stable")
    wanted = order[~held[order]][:most]
    held_score = np.where(holder >= 0, score[np.maximum(holder, 0)], -np.inf)  # [S]
    victims = np.argsort(held_score, kind="stable")
    out = []
    for e, s in zip(wanted.tolist(), victims.tolist()):
        bar = MARGIN if holder[s] < 0 else RATIO * held_score[s] + MARGIN
        if score[e] <= bar:
            break
        out.append((s, e))
    return out
