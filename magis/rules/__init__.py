"""M-Rules (MAGIS §5): F-Trans as a rewrite and the F-Tree mutation rules (§5.1)."""
