"""Decoding loops: plain (one target forward per token) and speculative."""
