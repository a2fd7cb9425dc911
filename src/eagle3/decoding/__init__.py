"""Decoding: the speculative round (round.py) and its seam types, the backends it runs on,
acceptance, trees, sampling and the cost model."""
