"""``python -m modeld.testmodels tiny|realistic|recurrent|copying|reply|think|swa-gemma3|... [--cache-dir DIR] [--seed N]``.

Generates the model if it is not cached yet and prints the path of its GGUF file (and nothing
else on stdout), so scripts can use ``MODEL=$(python -m modeld.testmodels tiny)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from modeld.testmodels import (
    ARCH_SPECS,
    COPYING,
    REALISTIC,
    RECURRENT,
    REPLY,
    THINK,
    TINY,
    TOOLS,
    ArchSpec,
    ModelSpec,
    default_cache_dir,
    ensure_model,
)

_SPECS: dict[str, ModelSpec | ArchSpec] = {
    spec.name: spec for spec in (TINY, REALISTIC, RECURRENT, COPYING, REPLY, THINK, TOOLS, *ARCH_SPECS)
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m modeld.testmodels",
        description="Generate (or find in the cache) a GGUF test model and print its path.",
    )
    parser.add_argument("model", choices=sorted(_SPECS), help="which spec to generate")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"where generated models live (default: $MODELD_MODEL_CACHE or {default_cache_dir()})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="weight and corpus seed (default: the spec's)",
    )
    args = parser.parse_args(argv)
    spec = _SPECS[args.model]
    if args.seed is not None:
        try:
            spec = dataclasses.replace(spec, seed=args.seed)
        except ValueError as exc:
            parser.error(str(exc))
    print(ensure_model(spec, args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
