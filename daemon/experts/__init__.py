"""Expert residency: which experts of a MoE layer stay in a fast tier, for both tiers (host RAM
and VRAM). The eviction and admission policies live here, with the replay simulator that scores
them against the offline optima.

This package imports nothing from `routing/`, `model/` or `backend/`: those import it.
"""
