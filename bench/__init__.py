"""pdlife's benchmarks; run each as a module from the repository root
(``python -m bench.lifecycle``) or all through ``pdlife bench``."""

from typing import Any, NoReturn


def bench_model(spec: str, **kwargs: Any) -> Any:
    """``load_model(spec, **kwargs)`` for a benchmark's ``--model``: a model that cannot be
    loaded ends the run with one line saying why, as the ``pdlife`` commands do."""
    import os
    import sys

    from scheduler.model.checkpoint import CheckpointError
    from scheduler.model.select import load_model
    from scheduler.model.shipped import ShippedModelMissing

    try:
        return load_model(spec, **kwargs)
    except (CheckpointError, ShippedModelMissing, ValueError) as exc:
        sys.exit(f"bench.{os.path.splitext(os.path.basename(sys.argv[0]))[0]}: --model: {exc}")


def part_of_transfer(module: str, run: str) -> NoReturn:
    """End ``python -m bench.<module>`` for a module that is a part of :mod:`bench.transfer`,
    not a benchmark of its own: say which ``bench.transfer`` command runs it (``run``), exit 2
    (whatever the arguments, ``--help`` included)."""
    import sys

    print(f"bench.{module} is a part of bench.transfer, not a benchmark of its own: run "
          f"{run}", file=sys.stderr)
    raise SystemExit(2)
