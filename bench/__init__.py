"""pdlife's benchmarks; run each as a module from the repository root
(``python -m bench.lifecycle``) or all through ``pdlife bench``."""
