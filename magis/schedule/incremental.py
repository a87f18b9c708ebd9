"""Incremental scheduling (MAGIS §6.1, Alg. 2) — filled in below."""
