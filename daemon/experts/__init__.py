"""Expert residency: which experts of a MoE layer stay in a fast tier, for both tiers (host RAM
and VRAM). The eviction and admission policies live here (policies.py), with the replay simulator that
scores them against the offline optima, and one layer's slot table as arrays (slots.py: which
expert each slot holds, pins, copies in flight), which the VRAM expert cache keeps per layer;
promotion between steps from counted use (promotion.py, the host tier's); where a miss computes,
copied to the GPU or on the CPU (offload.py, hybrid compute's cost model); the tiers' counters and
the request log replayed against Belady (stats.py).

This package imports nothing from `routing/`, `model/` or `backend/`: those import it.
"""
