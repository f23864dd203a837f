"""Rank collectives: the row gather the PrefillDelayer negotiates over, and TP agreement
(MIN-combined polls)."""
