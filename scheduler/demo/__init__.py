"""``pdlife demo``: options, the run on the embedded pair, the records it produces and the
report."""
