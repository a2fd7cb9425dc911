"""Decoding: the speculative round (round.py) and its seam types, the runners it runs on,
acceptance, trees, sampling and the cost model."""
