"""A real model offline and what is measured on it: attention error against dense, per-layer metrics, the needle and
the demo."""
